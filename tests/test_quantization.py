"""`--quantization`: projections and LM head stored in 8 bits at load time (int8; w8a16, the same
weights with inputs rounded to bfloat16; w8a16_int, with inputs quantized to 16-bit integers), or a
GGUF file's blocks kept as they are (gguf), on the real SmolLM2; and `--kv-cache-dtype bfloat16`, a
float32 model's K and V stored in 16 bits, held to the same bar.

The issue's bar for 8-bit weights: greedy output on the parity prompts unchanged for at least 30
of the first 32 tokens, and perplexity on a fixed text within 1% of float32. Three of the eight
parity prompts reach a near-tie in float32 itself within 32 tokens (top-2 logprob gaps of 0.008,
0.014 and 0.02), and on an AMD Zen 4 machine a fourth (0.007), float32's own sums rounding
differently there: any 8-bit rounding may flip those, so a prompt may diverge earlier only at a
position where float32's own top two are within NEAR_TIE. Plus the options' errors and a tiny
model in each 8-bit format.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_real_checkpoints import PROMPTS as PARITY_PROMPTS
from tests.tiny_models import make_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.engine.core import determine_num_blocks
from tokenmill.model.loader import load_model

pytestmark = pytest.mark.slow

NEAR_TIE = 0.05  # logprob gap between float32's top two tokens
TEXT = (
    "The river rises in the hills above the town and runs south through farmland for forty miles "
    "before it reaches the sea. In spring the snowmelt swells it, and the old stone bridge at the "
    "market square has been rebuilt twice after floods. Fishermen still work the estuary, where "
    "the water is brackish and the tides reach far inland."
)
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512, num_blocks=300)


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load_model(smollm2_path)


@pytest.fixture(scope="module")
def fp32(smollm2):
    return LLM(smollm2, **ENGINE)


def perplexity(llm: LLM) -> float:
    out = llm.generate([TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    logprobs = [pos[token].logprob for pos, token in zip(out.prompt_logprobs[1:], ids[1:])]
    return math.exp(-np.mean(logprobs))


@pytest.mark.parametrize("kind,kv_cache_dtype", [("int8", "auto"), ("w8a16", "auto"), ("w8a16_int", "auto"),
                                                  ("w8a16_int", "bfloat16")])
def test_8bit_weights_keep_greedy_output_and_perplexity(smollm2, fp32, kind, kv_cache_dtype):
    """int8: float32 inputs; w8a16: the same weights, inputs rounded to bfloat16 (multiplied with
    AMX or AVX512-BF16 where the CPU has them); w8a16_int: inputs quantized to 16-bit integers
    (integer dot products, AVX512-VNNI where the CPU has it), also with a bfloat16 KV cache (the two
    roundings together still meet the bar)."""
    quantized = LLM(smollm2, quantization=kind, kv_cache_dtype=kv_cache_dtype, **ENGINE)
    assert quantized.engine.model.config.quantization == kind
    assert str(quantized.engine.model.params["layers"]["wq"].dtype) == "int8"
    assert_near_float32(fp32, quantized)


def assert_near_float32(fp32: LLM, quantized: LLM) -> None:
    """The issue's bar: greedy output as float32's for 30 of the first 32 tokens on every parity prompt
    but at a float32 near tie, and perplexity within 1%."""
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    diverged = []
    for a, b in zip(fp32.generate(PARITY_PROMPTS, greedy, use_tqdm=False),
                    quantized.generate(PARITY_PROMPTS, greedy, use_tqdm=False)):
        x, y = a.outputs[0].token_ids, b.outputs[0].token_ids
        agree = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
        if agree < 30:
            top2 = sorted((lp.logprob for lp in a.outputs[0].logprobs[agree].values()), reverse=True)[:2]
            assert top2[0] - top2[1] < NEAR_TIE, (a.prompt, agree, top2, x, y)
            diverged.append(a.prompt)
    assert len(diverged) <= len(PARITY_PROMPTS) // 2, diverged  # the four without a near tie agree
    p32, p8 = perplexity(fp32), perplexity(quantized)
    assert abs(p8 - p32) <= 0.01 * p32, (p32, p8)


def test_bfloat16_kv_cache_keeps_greedy_output_and_perplexity(smollm2, fp32):
    """--kv-cache-dtype bfloat16 (llama.cpp keeps its cache in 16 bits by default): a block takes half
    the bytes, so a budget holds twice the blocks, and a float32 model's output meets int8's bar."""
    budget = 256 << 20
    full = determine_num_blocks(EngineConfig(cache=CacheConfig(kv_cache_memory=budget)), smollm2)
    half = determine_num_blocks(
        EngineConfig(cache=CacheConfig(kv_cache_memory=budget, kv_cache_dtype="bfloat16")), smollm2
    )
    assert half == 2 * full
    bf16_cache = LLM(smollm2, kv_cache_dtype="bfloat16", **ENGINE)
    runner = bf16_cache.engine.runner
    assert runner.kv_dtype == jnp.bfloat16
    # on CPU held as bfloat16 bits in uint16 (ops/attention.py: XLA:CPU's bfloat16 scatter copies the cache)
    assert runner.k_cache.dtype == runner.v_cache.dtype == jnp.uint16
    assert str(runner.params["layers"]["attn_norm"].dtype) == "float32"
    assert_near_float32(fp32, bf16_cache)


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_float8_on_a_tiny_model(tmp_path, kind):
    path = str(tmp_path / "llama")
    make_tiny_checkpoint("LlamaForCausalLM", path)
    tiny = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, num_blocks=32)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    fp32 = LLM(path, **tiny).generate([[5, 9, 77, 31]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    q = LLM(path, quantization=kind, **tiny)
    assert q.engine.model.config.quantization == kind
    out = q.generate([[5, 9, 77, 31]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 8 and out[0] == fp32[0]


def test_gguf_blocks_keep_the_float_models_greedy_output(smollm2_path, fp32):
    """--quantization gguf keeps the shipped file's Q4_1 projections 4-bit and its Q8_0 embedding as
    an int8 LM head. Decoded they are exactly the float model's weights, and the kernels multiply
    value by value: only the LM head's sums run in another order than XLA's, so greedy output is
    the float model's and the logprobs agree closely."""
    kept = LLM(smollm2_path, quantization="gguf", **ENGINE)
    cfg = kept.engine.model.config
    assert (cfg.quantization, cfg.quant_window) == ("gguf", 32)
    assert str(kept.engine.model.params["layers"]["w_up"].dtype) == "uint8"  # two 4-bit codes a byte
    assert str(kept.engine.model.params["lm_head_q"].dtype) == "int8"
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    for a, b in zip(fp32.generate(PARITY_PROMPTS, greedy, use_tqdm=False),
                    kept.generate(PARITY_PROMPTS, greedy, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, a.prompt
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert max(abs(x[t].logprob - y[t].logprob) for t in x) < 1e-3


def test_gguf_blocks_with_integer_inputs(smollm2_path, fp32):
    """--quantization gguf_int: the same kept blocks (4-bit codes in nibble quads where the CPU kernel
    runs), times inputs quantized to 16-bit integers: int8's bar, not gguf's exact output."""
    kept = LLM(smollm2_path, quantization="gguf_int", **ENGINE)
    cfg = kept.engine.model.config
    assert (cfg.quantization, cfg.quant_window, cfg.int16_inputs) == ("gguf_int", 32, True)
    assert str(kept.engine.model.params["layers"]["w_up"].dtype) == "uint8"
    assert_near_float32(fp32, kept)


def test_bad_options_name_the_field(smollm2, tmp_path):
    with pytest.raises(ValueError, match=r"quantization must be one of int8, fp8_e4m3, fp8_e5m2, w8a16, w8a16_int, gguf or "
                                         r"gguf_int, got 'int4'"):
        LLM(smollm2, quantization="int4", **ENGINE)
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'float32', 'bfloat16'\), got 'fp8'"):
        LLM(smollm2, kv_cache_dtype="fp8", **ENGINE)
    with pytest.raises(ValueError, match=r"quantization='gguf' keeps a GGUF file's blocks as the model loads"):
        LLM(smollm2, quantization="gguf", **ENGINE)  # a model loaded already, dequantized
    path = str(tmp_path / "gemma3")
    make_tiny_checkpoint("Gemma3ForCausalLM", path)
    with pytest.raises(ValueError, match=r"quantization='int8' is implemented for the Llama family"):
        LLM(path, quantization="int8", **ENGINE)
    # integer inputs are summed per 64-row window: a reduction of 96 rows has none
    path = str(tmp_path / "llama96")
    make_tiny_checkpoint("LlamaForCausalLM", path, intermediate_size=96)
    with pytest.raises(ValueError, match=r"quantization='w8a16_int' needs reduction axes that are multiples of 64"):
        LLM(path, quantization="w8a16_int", **ENGINE)
    LLM(path, quantization="int8", **ENGINE)  # per-column scales serve the float32 path
