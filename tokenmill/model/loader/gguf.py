"""GGUF files: config from metadata, weights dequantized to float and laid out like HF's (or, with
`--quantization gguf`, the projections and the LM head kept as the file's blocks: gguf_blocks.py).

Two things differ from an HF checkpoint of the same model:
- llama.cpp permutes the rows of Q and K for arch `llama` (its RoPE pairs adjacent dims, HF's pairs
  dims half a head apart); we undo it, as transformers' `LlamaTensorProcessor` does.
- Gemma norms are stored as the effective multiplier 1 + w (llama.cpp's converter adds the 1;
  transformers' `Gemma2TensorProcessor` subtracts it again). That is our params convention, so
  they are kept as they are.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
from gguf import GGMLQuantizationType as Q

from tokenmill.config import ModelConfig

from .errors import ModelLoadError
from .gguf_config import gguf_arch, gguf_to_hf_config
from .gguf_blocks import BLOCK, Blocks, read_blocks, stack_blocks
from .gguf_reader import GGUFFile
from .layout import assemble, param_shapes

logger = logging.getLogger(__name__)

SUPPORTED_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)

_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "bq": "attn_q.bias",
    "bk": "attn_k.bias",
    "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "mlp_norm": "ffn_norm.weight",  # gemma3: the pre-FFN norm
    "post_attn_norm": "post_attention_norm.weight",
    "post_ffn_norm": "post_ffw_norm.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
}
_TOP_NAMES = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}


def open_gguf(path: str) -> GGUFFile:
    gf = GGUFFile(path)
    gguf_arch(path, gf.metadata)  # fail on an unsupported architecture before anything else
    return gf


def load_gguf_config(gf: GGUFFile) -> ModelConfig:
    rope_freqs = gf.dequantize("rope_freqs.weight") if "rope_freqs.weight" in gf.tensors else None
    d = gguf_to_hf_config(gf.path, gf.metadata, gf.tensors, rope_freqs)
    try:
        return ModelConfig.from_hf_dict(d)
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{gf.path}: {e}") from None


class _GGUFSource:
    def __init__(self, gf: GGUFFile):
        self.where, self._gf = gf.path, gf

    def shape(self, name: str):
        info = self._gf.tensors.get(name)
        if info is None:
            return None
        if info.qtype not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{self.where}: tensor {name!r} has type {info.type_name}, which is not supported; supported "
                f"GGUF tensor types: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}"
            )
        return info.shape

    def read(self, name: str) -> np.ndarray:
        return self._gf.dequantize(name)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (per head: [x0 x2 x4.. x1 x3..] interleave -> halves).

    Same as transformers' LlamaTensorProcessor._reverse_permute_weights. Works for weights [out, in]
    and biases [out]."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_name(key: str, i: int | None) -> str:
    return _TOP_NAMES[key] if i is None else f"blk.{i}.{_LAYER_NAMES[key]}"


def _row_fix(gf: GGUFFile, cfg: ModelConfig):
    """fix(key, rows): undo llama.cpp's permutation of the rows of Q and K (arch `llama` only; not
    gemma3 / qwen2 / qwen3), for any array whose first axis is the weight's output rows."""
    heads = {"wq": cfg.num_heads, "bq": cfg.num_heads, "wk": cfg.num_kv_heads, "bk": cfg.num_kv_heads}

    def unpermute_qk(key: str, arr: np.ndarray) -> np.ndarray:
        return _unpermute(arr, heads[key]) if key in heads else arr

    return unpermute_qk if gf.metadata["general.architecture"] == "llama" else None


def load_gguf_params(gf: GGUFFile, cfg: ModelConfig, dtype) -> dict:
    return assemble(cfg, _GGUFSource(gf), _tensor_name, dtype, fix=_row_fix(gf, cfg))


# what --quantization gguf keeps as blocks: the dense projections (llama.LINEAR_WEIGHTS) and the LM head
_PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def load_gguf_blocks(gf: GGUFFile, cfg: ModelConfig, dtype) -> tuple[dict, ModelConfig]:
    """Like load_gguf_params, but the dense projections and the LM head stay the file's Q8_0 / Q4_0 /
    Q4_1 blocks (`ops.linear`'s quantized layout; 4-bit codes in the CPU kernel's strips), never
    dequantized; the config says so (quantization "gguf"). The embedding table is still read as
    float for the lookup."""
    from tokenmill.ops.cpu.linear import STRIP, to_uint4_strips

    if cfg.family != "llama" or cfg.is_moe:
        raise ModelLoadError(f"--quantization gguf keeps the blocks of dense Llama-family models; "
                             f"{cfg.architecture}{' (experts)' if cfg.is_moe else ''} is not one")
    kept = [k for k in _PROJECTIONS if k in param_shapes(cfg)[1]]
    fix = _row_fix(gf, cfg)
    params = assemble(cfg, _GGUFSource(gf), _tensor_name, dtype, fix=fix, skip=frozenset(kept) | {"lm_head"})
    offsets, types = [], {}

    def put(into: dict, key: str, blocks: Blocks) -> None:
        types[key] = blocks.qtype.name
        if blocks.is_4bit:
            if blocks.codes.shape[-1] % STRIP:
                raise ModelLoadError(f"{gf.path}: --quantization gguf keeps 4-bit blocks of weights whose outputs "
                                     f"are a multiple of {STRIP}; {key} has {blocks.codes.shape[-1]}")
            into[key] = np.asarray(to_uint4_strips(blocks.codes))
            into[key + "_offset"] = blocks.offset
            offsets.append(key)
        else:
            into[key] = blocks.codes
        into[key + "_scale"] = blocks.scale

    for key in kept:
        row_fix = (lambda rows, key=key: fix(key, rows)) if fix is not None else None
        per_layer = [read_blocks(gf, _tensor_name(key, i), row_fix) for i in range(cfg.num_layers)]
        put(params["layers"], key, stack_blocks(per_layer, key))
    head = _tensor_name("embed" if cfg.tie_word_embeddings else "lm_head", None)
    put(params, "lm_head_q", stack_blocks([read_blocks(gf, head)], "the LM head"))
    logger.info("kept the GGUF blocks as they are: %s", ", ".join(f"{k} {t}" for k, t in types.items()))
    return params, dataclasses.replace(cfg, quantization="gguf", quant_window=BLOCK, quant_offsets=tuple(offsets))
