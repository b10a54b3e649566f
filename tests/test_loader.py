"""The checkpoint loader: HF safetensors directories and GGUF files -> config, params, tokenizer.

Tiny random checkpoints are made here with transformers; GGUF versions of them are written with
gguf-py the way llama.cpp's converter writes them (names, Q/K row permutation, Gemma norms + 1).
The real SmolLM2 and Gemma 3 GGUFs are checked against transformers' own GGUF loading.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tokenmill.model.loader import LoadedModel, ModelLoadError, load_config, load_model, load_tokenizer
from tokenmill.model.loader.gguf import load_gguf_config, load_gguf_params, open_gguf
from tokenmill.model.loader.gguf_reader import GGUFFile
from tokenmill.model.loader.layout import HOST_ALIGNMENT

VOCAB = 256
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM")
GEMMA_NORMS = {"attn_norm", "post_attn_norm", "mlp_norm", "post_ffn_norm", "q_norm", "k_norm", "final_norm"}


# ---------------------------------------------------------------------------------------------
# tiny HF checkpoints


def _tiny_hf_config(arch: str):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return {
        "LlamaForCausalLM": lambda: transformers.LlamaConfig(**common, tie_word_embeddings=False),
        "Qwen2ForCausalLM": lambda: transformers.Qwen2Config(**common, tie_word_embeddings=True),
        "Qwen3ForCausalLM": lambda: transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False),
        "Gemma3ForCausalLM": lambda: transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3}, head_dim=32, sliding_window=16, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    }[arch]()


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {f"w{i}": i for i in range(4, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="<pad>")
    out.chat_template = CHAT_TEMPLATE
    return out


def _save_tiny(arch: str, path: str, max_shard_size: str | None = None) -> dict[str, np.ndarray]:
    """Write a random checkpoint (norms random too, so Gemma's +1 shows); return its state dict."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_tiny_hf_config(arch))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    _tiny_tokenizer().save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 7]}, f)
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """arch -> (checkpoint dir, state dict), made once per module."""
    root = tmp_path_factory.mktemp("tiny_hf")
    return {arch: (str(root / arch), _save_tiny(arch, str(root / arch))) for arch in ARCHS}


def _hf_name(key: str, i: int | None, gemma: bool) -> str:
    """The spec of where each params entry comes from in an HF checkpoint."""
    if i is None:
        return {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}[key]
    leaf = {
        "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
        "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight", "bq": "self_attn.q_proj.bias",
        "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight",
        "k_norm": "self_attn.k_norm.weight",
        "mlp_norm": "pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight",
        "post_attn_norm": "post_attention_layernorm.weight", "post_ffn_norm": "post_feedforward_layernorm.weight",
        "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
    }[key]
    return f"model.layers.{i}.{leaf}"


def _expected(sd: dict, key: str, i: int | None, gemma: bool) -> np.ndarray:
    w = sd[_hf_name(key, i, gemma)]
    if gemma and key in GEMMA_NORMS:
        w = w + np.float32(1.0)
    return w.T if w.ndim == 2 and key != "embed" else w


def _assert_params_match_state_dict(params: dict, sd: dict, num_layers: int, gemma: bool):
    for key, arr in params.items():
        if key != "layers":
            np.testing.assert_array_equal(arr, _expected(sd, key, None, gemma), err_msg=key)
    for key, arr in params["layers"].items():
        assert arr.shape[0] == num_layers, key
        for i in range(num_layers):
            np.testing.assert_array_equal(arr[i], _expected(sd, key, i, gemma), err_msg=f"{key}[{i}]")


LAYER_KEYS = {
    "LlamaForCausalLM": set(),
    "Qwen2ForCausalLM": {"bq", "bk", "bv"},
    "Qwen3ForCausalLM": {"q_norm", "k_norm"},
    "Gemma3ForCausalLM": {"q_norm", "k_norm", "post_attn_norm", "post_ffn_norm"},
}
BASE_LAYER_KEYS = {"attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"}


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_tiny_checkpoint(tiny, arch):
    path, sd = tiny[arch]
    m = load_model(path)
    assert isinstance(m, LoadedModel) and m.source == path
    cfg = m.config
    assert cfg.architecture == arch and cfg.num_layers == (3 if "Gemma" in arch else 2)
    assert cfg.eos_token_ids == (2, 7)  # config's, then generation_config's
    assert set(m.params["layers"]) == BASE_LAYER_KEYS | LAYER_KEYS[arch]
    assert ("lm_head" in m.params) == (not cfg.tie_word_embeddings)
    assert all(a.dtype == np.float32 for a in [m.params["embed"], *m.params["layers"].values()])
    _assert_params_match_state_dict(m.params, sd, cfg.num_layers, gemma="Gemma" in arch)
    assert m.chat_template == CHAT_TEMPLATE
    # the tokenizer is AutoTokenizer's; beware that for some model types (qwen2) transformers 5 swaps in
    # its own class, which rebuilds the pipeline from tokenizer.json's vocab (here: word-level is lost)
    from transformers import AutoTokenizer

    text = "w5 w9 zzz"
    assert m.tokenizer.encode(text) == AutoTokenizer.from_pretrained(path).encode(text)
    if arch != "Qwen2ForCausalLM":
        assert m.tokenizer.encode(text, add_special_tokens=False) == [5, 9, 3]
    if "Gemma" in arch:
        assert cfg.sliding_layers() == (True, True, False) and cfg.query_pre_attn_scalar == 24


def test_hf_sharded_checkpoint_loads_the_same(tmp_path):
    path = str(tmp_path / "sharded")
    sd = _save_tiny("LlamaForCausalLM", path, max_shard_size="100KB")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 2
    m = load_model(path)
    _assert_params_match_state_dict(m.params, sd, 2, gemma=False)


def test_hf_dtype_conversion(tiny):
    path, sd = tiny["Gemma3ForCausalLM"]
    m = load_model(path, dtype=ml_dtypes.bfloat16)
    assert m.params["layers"]["wq"].dtype == ml_dtypes.bfloat16
    # 1 + w is formed in fp32 and rounded once
    want = (sd["model.layers.0.input_layernorm.weight"] + 1).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(m.params["layers"]["attn_norm"][0], want)


def test_weights_go_to_the_cpu_device_without_a_copy(tiny):
    """assemble's arrays start on HOST_ALIGNMENT boundaries, where XLA's CPU client takes a host buffer as
    it is: placing the weights copies nothing (numpy alone aligns to 16 bytes)."""
    import jax

    path, _ = tiny["LlamaForCausalLM"]
    m = load_model(path, tokenizer=False)
    arrays = [m.params["embed"], m.params["final_norm"], *m.params["layers"].values()]
    assert all(a.ctypes.data % HOST_ALIGNMENT == 0 for a in arrays)
    wq = m.params["layers"]["wq"]
    assert jax.device_put(wq).unsafe_buffer_pointer() == wq.ctypes.data


def test_gemma3_multimodal_checkpoint_prefixes_are_stripped(tiny, tmp_path):
    """Gemma3ForConditionalGeneration: text weights under model.language_model., vision ignored."""
    from safetensors.numpy import save_file

    src, sd = tiny["Gemma3ForCausalLM"]
    path = tmp_path / "mm"
    shutil.copytree(src, path)
    os.remove(path / "model.safetensors")
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in sd.items() if k != "lm_head.weight"}
    tensors["model.vision_tower.patch_embed.weight"] = np.zeros((3, 4), np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    text = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                  "text_config": text}))
    m = load_model(str(path))
    assert m.config.architecture == "Gemma3ForCausalLM"
    _assert_params_match_state_dict(m.params, sd, 3, gemma=True)


# ---------------------------------------------------------------------------------------------
# tiny GGUF files, written the way llama.cpp's convert_hf_to_gguf.py writes them

GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
             "Gemma3ForCausalLM": "gemma3"}
GGUF_LEAF = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (the direction we must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(arch: str, sd: dict) -> dict[str, np.ndarray]:
    cfg = _tiny_hf_config(arch)
    gemma = arch.startswith("Gemma")
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    for name, w in sd.items():
        if not name.startswith("model.layers."):
            continue
        _, _, i, rest = name.split(".", 3)
        leaf = GGUF_LEAF.get(rest) or ("post_attention_norm.weight" if gemma else "ffn_norm.weight")
        if arch == "LlamaForCausalLM" and leaf.startswith(("attn_q.", "attn_k.")):
            w = _llamacpp_permute(w, cfg.num_attention_heads if "attn_q" in leaf else cfg.num_key_value_heads)
        if gemma and leaf.endswith("norm.weight"):
            w = w + np.float32(1.0)  # llama.cpp's Gemma3Model adds 1 to every norm
        out[f"blk.{i}.{leaf}"] = w
    if gemma:
        out["output_norm.weight"] = out["output_norm.weight"] + np.float32(1.0)
    return out


def _gguf_metadata(arch: str) -> dict:
    cfg = _tiny_hf_config(arch)
    a = GGUF_ARCH[arch]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    kv = {
        f"{a}.block_count": cfg.num_hidden_layers, f"{a}.context_length": 512,
        f"{a}.embedding_length": cfg.hidden_size, f"{a}.feed_forward_length": cfg.intermediate_size,
        f"{a}.attention.head_count": cfg.num_attention_heads,
        f"{a}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6, f"{a}.rope.freq_base": 10000.0,
        f"{a}.attention.key_length": head_dim, f"{a}.rope.dimension_count": head_dim,
        # a byte-level vocabulary: the byte symbols, but for two bytes UTF-8 never uses (0xF5, 0xF6),
        # whose places hold two merges
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [bytes_to_unicode()[b] for b in range(0xF5)] + ["he", "ll"]
        + [bytes_to_unicode()[b] for b in range(0xF7, 256)],
        "tokenizer.ggml.token_type": [1] * VOCAB, "tokenizer.ggml.merges": ["h e", "l l"],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }
    if a == "gemma3":
        kv[f"{a}.attention.sliding_window"] = 16
    return kv


def write_gguf(path, arch: str, kv: dict, tensors: dict[str, np.ndarray], types: dict | None = None) -> str:
    """A GGUF file; `types` maps tensor names to ggml types (default F32)."""
    w = gguf.GGUFWriter(str(path), arch)
    V = gguf.GGUFValueType
    for key, val in kv.items():
        if isinstance(val, bool):
            w.add_key_value(key, val, V.BOOL)
        elif isinstance(val, int):
            w.add_key_value(key, val, V.UINT32)
        elif isinstance(val, float):
            w.add_key_value(key, val, V.FLOAT32)
        elif isinstance(val, str):
            w.add_key_value(key, val, V.STRING)
        else:
            sub = V.STRING if not val or isinstance(val[0], str) else V.INT32
            w.add_key_value(key, val, V.ARRAY, sub_type=sub)
    for name, arr in tensors.items():
        qtype = (types or {}).get(name, Q.F32)
        if qtype == Q.F32:
            w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
        elif qtype == Q.F16:
            w.add_tensor(name, np.ascontiguousarray(arr, np.float16))
        elif arr.dtype == np.uint8:  # raw blocks given
            w.add_tensor(name, arr, raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(arr, np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def tiny_gguf(path, arch: str, sd: dict, *, drop=(), types=None, kv=None, extra=None) -> str:
    tensors = {k: v for k, v in _gguf_tensors(arch, sd).items() if k not in drop} | (extra or {})
    return write_gguf(path, GGUF_ARCH[arch], _gguf_metadata(arch) | (kv or {}), tensors, types)


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_of_the_same_weights_loads_like_the_hf_checkpoint(tiny, tmp_path, arch):
    hf_dir, sd = tiny[arch]
    hf = load_model(hf_dir)
    gg = load_model(tiny_gguf(tmp_path / "m.gguf", arch, sd))
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "tie_word_embeddings", "attention_bias", "qk_norm", "hidden_act", "sliding_window"):
        assert getattr(gg.config, field) == getattr(hf.config, field), field
    assert gg.config.architecture == arch and gg.config.eos_token_ids == (2,)
    assert set(gg.params["layers"]) == set(hf.params["layers"])
    for key in set(gg.params) - {"layers"}:
        np.testing.assert_array_equal(gg.params[key], hf.params[key], err_msg=key)
    for key in gg.params["layers"]:
        np.testing.assert_array_equal(gg.params["layers"][key], hf.params["layers"][key], err_msg=key)
    assert gg.tokenizer.decode(gg.tokenizer.encode("héllo wörld")) == "héllo wörld"
    assert gg.tokenizer.encode("hello") == [0xF5, 0xF6, ord("o")]


def _roundtrip(w: np.ndarray, qtype) -> np.ndarray:
    if qtype == Q.F16:
        return w.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w.astype(np.float32), qtype), qtype)


def test_gguf_quant_types_dequantize(tiny, tmp_path):
    """Each tensor in another ggml type; the loader must give exactly dequantize(quantize(w))."""
    _, sd = tiny["LlamaForCausalLM"]
    types = {"token_embd.weight": Q.BF16, "output.weight": Q.Q8_0, "blk.0.attn_k.weight": Q.F16,
             "blk.0.attn_v.weight": Q.Q8_0, "blk.0.attn_output.weight": Q.Q4_0, "blk.0.ffn_gate.weight": Q.Q4_1,
             "blk.0.ffn_up.weight": Q.Q5_0, "blk.0.ffn_down.weight": Q.Q5_1, "blk.1.attn_q.weight": Q.Q8_0}
    m = load_model(tiny_gguf(tmp_path / "q.gguf", "LlamaForCausalLM", sd, types=types))
    L = m.params["layers"]
    checks = {  # (ours, HF weight [out, in], type); row-wise quantization commutes with the Q/K row permutation
        "embed": (m.params["embed"].T, sd["model.embed_tokens.weight"].T, Q.BF16),
        "lm_head": (m.params["lm_head"], sd["lm_head.weight"], Q.Q8_0),
        "wk0": (L["wk"][0], sd["model.layers.0.self_attn.k_proj.weight"], Q.F16),
        "wv0": (L["wv"][0], sd["model.layers.0.self_attn.v_proj.weight"], Q.Q8_0),
        "wo0": (L["wo"][0], sd["model.layers.0.self_attn.o_proj.weight"], Q.Q4_0),
        "gate0": (L["w_gate"][0], sd["model.layers.0.mlp.gate_proj.weight"], Q.Q4_1),
        "up0": (L["w_up"][0], sd["model.layers.0.mlp.up_proj.weight"], Q.Q5_0),
        "down0": (L["w_down"][0], sd["model.layers.0.mlp.down_proj.weight"], Q.Q5_1),
        "wq1": (L["wq"][1], sd["model.layers.1.self_attn.q_proj.weight"], Q.Q8_0),
    }
    for what, (ours, w, qtype) in checks.items():
        if what == "embed":
            np.testing.assert_array_equal(ours.T, _roundtrip(w.T, qtype), err_msg=what)
        else:
            np.testing.assert_array_equal(ours, _roundtrip(w, qtype).T, err_msg=what)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("blocks", [1, 7, (1 << 15) + 3])
def test_whole_tensor_dequantize_is_bit_equal_to_gguf_quants(qtype, blocks):
    """The fast path against gguf.quants on arbitrary bytes (any scale, inf and NaN included), across
    the chunk boundary."""
    from tokenmill.model.loader.gguf_reader import dequantize_q4_1_q8_0

    raw = np.random.default_rng(blocks).integers(0, 256, (blocks, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8)
    with np.errstate(invalid="ignore"):  # inf scales times zero
        np.testing.assert_array_equal(dequantize_q4_1_q8_0(raw, qtype), gguf.quants.dequantize(raw, qtype).reshape(-1))


# one kept type per projection (the same in every layer); the untied LM head in Q8_0
KEPT_TYPES = {"attn_q": Q.Q4_0, "attn_k": Q.Q8_0, "attn_v": Q.Q4_1, "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_1,
              "ffn_up": Q.Q4_0, "ffn_down": Q.Q8_0}


def kept_types(layers: int) -> dict:
    return {f"blk.{i}.{t}.weight": q for i in range(layers) for t, q in KEPT_TYPES.items()} | {
        "output.weight": Q.Q8_0}


def test_gguf_blocks_are_kept_value_for_value(tiny, tmp_path):
    """--quantization gguf: Q8_0 blocks become int8 codes with their scales, Q4_0 / Q4_1 blocks 4-bit
    codes in the kernel's strips with scales and offsets; decoded, each is exactly what the
    dequantizing loader gives (Q and K rows unpermuted alike)."""
    from tokenmill.ops.cpu.linear import from_uint4_strips

    _, sd = tiny["LlamaForCausalLM"]
    path = tiny_gguf(tmp_path / "q.gguf", "LlamaForCausalLM", sd, types=kept_types(2))
    floats, kept = load_model(path), load_model(path, keep_gguf_blocks=True)
    c = kept.config
    assert (c.quantization, c.quant_window) == ("gguf", 32)
    assert set(c.quant_offsets) == {"wq", "wv", "w_gate", "w_up"}
    assert "lm_head" not in kept.params and kept.params["lm_head_q"].dtype == np.int8

    def decoded(stack: dict, key: str) -> np.ndarray:
        codes = stack[key]
        if key in c.quant_offsets:
            assert codes.dtype == np.uint8 and codes.shape[-1] == 16
            codes = np.asarray(from_uint4_strips(codes))
        else:
            assert codes.dtype == np.int8
        L, K, N = codes.shape
        values = codes.astype(np.float32).reshape(L, K // 32, 32, N) * stack[key + "_scale"][:, :, None]
        if key + "_offset" in stack:
            values = values + stack[key + "_offset"][:, :, None]
        return values.reshape(L, K, N)

    for key in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        np.testing.assert_array_equal(decoded(kept.params["layers"], key), floats.params["layers"][key], err_msg=key)
    np.testing.assert_array_equal(decoded(kept.params, "lm_head_q")[0], floats.params["lm_head"])
    np.testing.assert_array_equal(kept.params["embed"], floats.params["embed"])


def test_gguf_blocks_refuse_what_they_cannot_keep(tiny, tmp_path):
    hf_dir, sd = tiny["LlamaForCausalLM"]
    with pytest.raises(ModelLoadError, match=r"keeps the blocks of a GGUF file; .* is an HF checkpoint"):
        load_model(hf_dir, keep_gguf_blocks=True)
    floats = tiny_gguf(tmp_path / "f.gguf", "LlamaForCausalLM", sd)  # every tensor F32
    with pytest.raises(ModelLoadError, match=r"'blk.0.attn_q.weight' is F32; --quantization gguf keeps Q4_0, Q4_1, "
                                             r"Q8_0 blocks"):
        load_model(floats, keep_gguf_blocks=True)
    mixed = tiny_gguf(tmp_path / "m.gguf", "LlamaForCausalLM", sd, types=kept_types(2) | {
        "blk.1.attn_q.weight": Q.Q8_0})
    with pytest.raises(ModelLoadError, match=r"the layers of wq mix Q4_0, Q8_0"):
        load_model(mixed, keep_gguf_blocks=True)


def _llamacpp_llama3_rope_factors(head_dim: int, base: float, factor: float) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors (Llama 3.1+ rope_freqs)."""
    import math

    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low, high, old_len = 1.0, 4.0, 8192
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def test_gguf_llama3_rope_freqs_become_rope_scaling(tiny, tmp_path):
    _, sd = tiny["LlamaForCausalLM"]
    kv = {"llama.rope.freq_base": 500000.0}
    freqs = _llamacpp_llama3_rope_factors(16, 500000.0, 32.0)
    assert 1 < len(set(freqs.tolist())) and freqs.min() == 1 and freqs.max() == 32  # all three bands
    c = load_config(tiny_gguf(tmp_path / "a.gguf", "LlamaForCausalLM", sd, kv=kv, extra={"rope_freqs.weight": freqs}))
    assert c.rope_scaling_dict == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    bad = freqs.copy()
    bad[3] += 0.5
    p = tiny_gguf(tmp_path / "b.gguf", "LlamaForCausalLM", sd, kv=kv, extra={"rope_freqs.weight": bad})
    with pytest.raises(ModelLoadError, match="rope_freqs tensor does not match Llama 3 RoPE scaling"):
        load_config(p)


def test_runtime_does_not_need_torch(tiny, tmp_path):
    """Loading an HF dir and a GGUF (tokenizers included) works with torch unimportable."""
    hf_dir, sd = tiny["Qwen3ForCausalLM"]
    gguf_path = tiny_gguf(tmp_path / "m.gguf", "LlamaForCausalLM", tiny["LlamaForCausalLM"][1])
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
        "from tokenmill.model.loader import load_model\n"
        "for p in sys.argv[1:]:\n"
        "    m = load_model(p); assert m.tokenizer.encode('w5') and m.params['embed'].shape[0] == 256\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code, hf_dir, gguf_path], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# bad inputs: every one a ModelLoadError naming the culprit


def _copy(tiny, arch, tmp_path) -> str:
    dst = str(tmp_path / "ckpt")
    shutil.copytree(tiny[arch][0], dst)
    return dst


def _edit_json(path, **changes):
    d = json.load(open(path))
    d.update(changes)
    json.dump(d, open(path, "w"))


def test_error_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match=r"does not exist.*\.gguf"):
        load_model(str(tmp_path / "nope"))


def test_error_not_a_model_file(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ModelLoadError, match="not a model"):
        load_model(str(tmp_path / "x.bin"))


def test_error_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_error_directory_without_safetensors(tiny, tmp_path):
    path = _copy(tiny, "LlamaForCausalLM", tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(path)


def test_error_unsupported_architecture(tiny, tmp_path):
    path = _copy(tiny, "LlamaForCausalLM", tmp_path)
    _edit_json(os.path.join(path, "config.json"), architectures=["BertForMaskedLM"])
    with pytest.raises(ModelLoadError, match=r"config.json.*'BertForMaskedLM'.*supported: LlamaForCausalLM"):
        load_model(path)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_error_corrupt_safetensors(tiny, tmp_path, damage):
    path = _copy(tiny, "LlamaForCausalLM", tmp_path)
    f = os.path.join(path, "model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(os.urandom(4096) if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors: corrupt or truncated"):
        load_model(path)


def test_error_sharded_index_names_a_missing_shard(tmp_path):
    path = str(tmp_path / "sharded")
    _save_tiny("LlamaForCausalLM", path, max_shard_size="100KB")
    shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[0]
    os.remove(os.path.join(path, shard))
    with pytest.raises(ModelLoadError, match=f"{shard}.*missing"):
        load_model(path)


def test_error_missing_tensor(tiny, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = _copy(tiny, "Qwen2ForCausalLM", tmp_path)
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, f)
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model.layers.1.self_attn.k_proj.bias'"):
        load_model(path)


def test_error_tensor_shape_disagrees_with_config(tiny, tmp_path):
    path = _copy(tiny, "LlamaForCausalLM", tmp_path)
    _edit_json(os.path.join(path, "config.json"), intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \(128, 64\).*\(96, 64\)"):
        load_model(path)


def test_error_tokenizer_cannot_be_built(tiny, tmp_path):
    path = _copy(tiny, "LlamaForCausalLM", tmp_path)
    open(os.path.join(path, "tokenizer.json"), "w").write("{not json")
    with pytest.raises(ModelLoadError, match="cannot build a tokenizer"):
        load_model(path)


def test_error_gguf_unsupported_architecture(tmp_path):
    p = write_gguf(tmp_path / "phi.gguf", "phi3", {"phi3.block_count": 2}, {"x.weight": np.zeros((2, 32))})
    with pytest.raises(ModelLoadError, match=r"phi.gguf: GGUF architecture 'phi3'.*supported.*llama.*gemma3"):
        load_model(p)


def test_error_gguf_unsupported_tensor_type(tiny, tmp_path):
    _, sd = tiny["LlamaForCausalLM"]
    rows = np.zeros((32, 64 // 32 * 18), np.uint8)  # IQ4_NL blocks: 32 values in 18 bytes
    p = tiny_gguf(tmp_path / "iq.gguf", "LlamaForCausalLM", sd, types={"blk.1.attn_v.weight": Q.IQ4_NL},
                  extra={"blk.1.attn_v.weight": rows})
    with pytest.raises(ModelLoadError, match=r"'blk.1.attn_v.weight' has type IQ4_NL.*supported.*Q4_K.*Q8_0"):
        load_model(p)


def test_error_gguf_missing_tensor_and_metadata(tiny, tmp_path):
    _, sd = tiny["LlamaForCausalLM"]
    p = tiny_gguf(tmp_path / "a.gguf", "LlamaForCausalLM", sd, drop={"blk.1.ffn_up.weight"})
    with pytest.raises(ModelLoadError, match=r"missing tensor 'blk.1.ffn_up.weight'"):
        load_model(p)
    p = tiny_gguf(tmp_path / "b.gguf", "LlamaForCausalLM", sd, kv={"llama.feed_forward_length": 96})
    with pytest.raises(ModelLoadError, match=r"'blk.0.ffn_gate.weight' has shape \(128, 64\)"):
        load_model(p)
    kv = _gguf_metadata("LlamaForCausalLM")
    del kv["llama.block_count"]
    p = write_gguf(tmp_path / "c.gguf", "llama", kv, _gguf_tensors("LlamaForCausalLM", sd))
    with pytest.raises(ModelLoadError, match=r"lacks 'llama.block_count'"):
        load_model(p)


def test_error_gguf_tokenizer_cannot_be_built(tiny, tmp_path):
    _, sd = tiny["LlamaForCausalLM"]
    p = tiny_gguf(tmp_path / "t.gguf", "LlamaForCausalLM", sd, kv={"tokenizer.ggml.model": "bogus"})
    with pytest.raises(ModelLoadError, match=r"cannot build a tokenizer.*'bogus'"):
        load_model(p)


def test_error_gguf_garbage_and_truncated(smollm2_path, tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "junk.gguf").write_bytes(os.urandom(4096))
    with open(smollm2_path, "rb") as f:
        head = f.read(4 << 20)
    data_start = min(t.offset for t in GGUFFile(smollm2_path).tensors.values())
    (tmp_path / "cut_meta.gguf").write_bytes(head[:100_000])  # inside the vocabulary
    (tmp_path / "cut_data.gguf").write_bytes(head[: data_start + 1000])  # inside the first tensor
    # a metadata count of 2**60: must fail at once, not loop
    (tmp_path / "count.gguf").write_bytes(head[:16] + (2**60).to_bytes(8, "little") + head[24:4096])
    cases = {"empty.gguf": "truncated", "junk.gguf": "not a GGUF file", "cut_meta.gguf": "truncated or corrupt",
             "cut_data.gguf": r"truncated GGUF file: tensor '.*' ends at byte", "count.gguf": "truncated or corrupt"}
    for name, msg in cases.items():
        with pytest.raises(ModelLoadError, match=msg):
            load_model(str(tmp_path / name))


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct GGUF (the embedded default)


@pytest.fixture(scope="module")
def smollm2(smollm2_path) -> LoadedModel:
    return load_model(None)


def test_smollm2_default_model(smollm2, smollm2_path):
    c = smollm2.config
    assert smollm2.source == smollm2_path
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "LlamaForCausalLM", 30, 576, 9, 3, 64)
    assert (c.vocab_size, c.intermediate_size, c.tie_word_embeddings, c.rope_theta) == (49152, 1536, True, 100000.0)
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1
    p = smollm2.params
    assert "lm_head" not in p and p["embed"].shape == (49152, 576)
    assert p["layers"]["wq"].shape == (30, 576, 576) and p["layers"]["wk"].shape == (30, 576, 192)
    assert p["layers"]["w_down"].shape == (30, 1536, 576) and p["layers"]["w_down"].dtype == np.float32
    assert "<|im_start|>" in smollm2.chat_template
    assert load_config(None) == c


def _smollm2_reference_tokenizer(smollm2_path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(os.path.dirname(smollm2_path),
                                                   gguf_file=os.path.basename(smollm2_path))


def test_smollm2_tokenizer_matches_transformers(smollm2, smollm2_path):
    _assert_smollm2_tokenizer_matches(smollm2.tokenizer, _smollm2_reference_tokenizer(smollm2_path))


def test_smollm2_tokenizer_read_back_from_the_cache(smollm2_path, tmp_path, monkeypatch):
    """The GGUF tokenizer as transformers converts it is kept in TOKENMILL_TOKENIZER_CACHE_DIR; the next
    load reads it back without converting (the converter made to fail proves it) and tokenizes the same.
    A damaged entry is converted and written again."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping

    monkeypatch.setenv("TOKENMILL_TOKENIZER_CACHE_DIR", str(tmp_path))
    load_tokenizer(smollm2_path)
    kept = sorted(os.listdir(tmp_path))
    assert len(kept) == 2 and kept[0].endswith(".json") and kept[1].endswith(".kwargs.json")
    with monkeypatch.context() as m:
        m.setattr(gguf_tokenizer_mapping, "convert_gguf_tokenizer", None)  # any conversion now fails
        tok, chat_template = load_tokenizer(smollm2_path)
    _assert_smollm2_tokenizer_matches(tok, _smollm2_reference_tokenizer(smollm2_path))
    assert tok.chat_template == chat_template and "<|im_start|>" in chat_template
    (tmp_path / kept[0]).write_text("{not json")
    tok, _ = load_tokenizer(smollm2_path)
    assert tok.encode("Hello world") == [19556, 905]
    assert json.loads((tmp_path / kept[0]).read_text())["model"]["type"] == "BPE"  # written again


def _assert_smollm2_tokenizer_matches(tok, ref):
    assert tok.encode("Hello world") == ref.encode("Hello world") == [19556, 905]  # no BOS added
    for text in [" Hello  world\n\n", "<|im_start|>user\nHi!<|im_end|>", "naïve café 日本語 🤖 1234567", ""]:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids) == text
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (ref.bos_token, ref.eos_token, ref.pad_token)
    msgs = [{"role": "user", "content": "Hi"}]
    ours = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.endswith("<|im_start|>assistant\n") and "You are a helpful AI assistant" in ours


def test_smollm2_qk_unpermute_matches_transformers_processor(smollm2, smollm2_path):
    """transformers' own GGUF Q/K fix (LlamaTensorProcessor) applied to the raw tensor gives ours."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    proc = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    gf = GGUFFile(smollm2_path)
    for key, name in [("wq", "blk.0.attn_q.weight"), ("wk", "blk.0.attn_k.weight"), ("wk", "blk.29.attn_k.weight")]:
        layer = int(name.split(".")[1])
        ref = proc.process(gf.dequantize(name), name).weights
        np.testing.assert_array_equal(smollm2.params["layers"][key][layer], ref.T, err_msg=name)
    np.testing.assert_array_equal(smollm2.params["layers"]["wv"][0], gf.dequantize("blk.0.attn_v.weight").T)


@pytest.fixture(scope="module")
def smollm2_transformers(smollm2_path):
    """transformers' model from the same GGUF (~35 s: its GGUF reading is slow). The config is given,
    which skips a second pass over the file; transformers still un-permutes Q/K with the head counts
    it reads from the file itself."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                      tie_word_embeddings=True)
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path), config=config)


@pytest.mark.slow
def test_smollm2_weights_match_transformers_model(smollm2, smollm2_transformers):
    sd = {k: v.float().numpy() for k, v in smollm2_transformers.state_dict().items()}
    for key, name in [("wq", "self_attn.q_proj.weight"), ("wk", "self_attn.k_proj.weight"),
                      ("wo", "self_attn.o_proj.weight"), ("w_down", "mlp.down_proj.weight"),
                      ("mlp_norm", "post_attention_layernorm.weight")]:
        for i in (0, 29):
            w = sd[f"model.layers.{i}.{name}"]
            np.testing.assert_array_equal(smollm2.params["layers"][key][i], w.T if w.ndim == 2 else w,
                                          err_msg=f"{key}[{i}]")
    np.testing.assert_array_equal(smollm2.params["embed"], sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(smollm2.params["final_norm"], sd["model.norm.weight"])


# ---------------------------------------------------------------------------------------------
# Gemma 3 270M GGUF


@pytest.fixture(scope="module")
def gemma3(gemma3_path):
    gf = open_gguf(gemma3_path)
    return gf, load_gguf_config(gf)


def test_gemma3_config(gemma3):
    _, c = gemma3
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("Gemma3ForCausalLM", 18, 640, 2048)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (4, 1, 256, 262144)
    assert (c.sliding_window, c.query_pre_attn_scalar, c.hidden_act) == (512, 256, "gelu_pytorch_tanh")
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling) == (1e6, 1e4, None)
    assert c.sliding_layers() == ((True,) * 5 + (False,)) * 3
    assert c.tie_word_embeddings and c.qk_norm and not c.attention_bias
    assert (c.bos_token_id, c.eos_token_ids, c.max_position_embeddings) == (2, (1,), 32768)


def test_gemma3_params(gemma3):
    """K-quants dequantize; norms are kept as stored, which is 1 + w: transformers subtracts 1."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    gf, c = gemma3
    p = load_gguf_params(gf, c, np.float32)
    L = p["layers"]
    assert p["embed"].shape == (262144, 640) and "lm_head" not in p
    assert L["wq"].shape == (18, 640, 1024) and L["wk"].shape == (18, 640, 256) and L["wo"].shape == (18, 1024, 640)
    assert L["q_norm"].shape == (18, 256) and L["post_ffn_norm"].shape == (18, 640)
    assert {gf.tensors[f"blk.0.{n}.weight"].type_name for n in ("attn_output", "ffn_down")} == {"Q4_K", "Q6_K"}
    proc = TENSOR_PROCESSORS["gemma3"]()
    for key, name in [("attn_norm", "attn_norm"), ("mlp_norm", "ffn_norm"), ("q_norm", "attn_q_norm"),
                      ("post_attn_norm", "post_attention_norm"), ("post_ffn_norm", "post_ffw_norm")]:
        raw = gf.dequantize(f"blk.3.{name}.weight")
        hf_w = proc.process(raw, f"blk.3.{name}.weight").weights  # what transformers calls w
        np.testing.assert_allclose(L[key][3], hf_w + 1, rtol=0, atol=1e-6, err_msg=key)
    for v in p["embed"][:2], L["w_down"][5], L["wo"][17]:
        assert np.isfinite(v).all() and v.std() > 0


@pytest.mark.slow
def test_gemma3_config_matches_transformers(gemma3, gemma3_path):
    from transformers import AutoConfig

    _, c = gemma3
    rc = AutoConfig.from_pretrained(os.path.dirname(gemma3_path), gguf_file=os.path.basename(gemma3_path))
    assert (rc.vocab_size, rc.hidden_size, rc.intermediate_size, rc.num_hidden_layers) == (
        c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers)
    assert (rc.num_attention_heads, rc.num_key_value_heads, rc.head_dim) == (c.num_heads, c.num_kv_heads, c.head_dim)
    assert (rc.sliding_window, tuple(rc.layer_types), rc.query_pre_attn_scalar) == (
        c.sliding_window, c.layer_types, c.query_pre_attn_scalar)
    assert rc.rope_parameters["full_attention"]["rope_theta"] == c.rope_theta
    assert rc.rope_parameters["sliding_attention"]["rope_theta"] == c.rope_local_theta
    assert (rc.hidden_activation, rc.tie_word_embeddings, rc.max_position_embeddings) == (
        c.hidden_act, c.tie_word_embeddings, c.max_position_embeddings)
    assert rc.rms_norm_eps == pytest.approx(c.rms_norm_eps)
    assert (rc.bos_token_id, (rc.eos_token_id,)) == (c.bos_token_id, c.eos_token_ids)


@pytest.mark.slow
def test_gemma3_tokenizer(gemma3_path):
    tok, template = load_tokenizer(gemma3_path)
    assert template is None  # the base model has no chat template
    assert tok.encode("Hello world") == [2, 9259, 1902]  # BOS added, as transformers' GGUF tokenizer does
    assert tok.decode(tok.encode(" Hello  world\n\n"), skip_special_tokens=True) == " Hello  world\n\n"
