"""GGUF files: config from metadata, weights dequantized to float and laid out like HF's.

Two things differ from an HF checkpoint of the same model:
- llama.cpp permutes the rows of Q and K for arch `llama` (its RoPE pairs adjacent dims, HF's pairs
  dims half a head apart); we undo it, as transformers' `LlamaTensorProcessor` does.
- Gemma norms are stored as the effective multiplier 1 + w (llama.cpp's converter adds the 1;
  transformers' `Gemma2TensorProcessor` subtracts it again). That is our params convention, so
  they are kept as they are.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

from tokenmill.config import ModelConfig

from .errors import ModelLoadError
from .gguf_config import gguf_arch, gguf_to_hf_config
from .gguf_reader import GGUFFile
from .layout import assemble

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


def load_gguf_params(gf: GGUFFile, cfg: ModelConfig, dtype) -> dict:
    def tensor_name(key: str, i: int | None) -> str:
        return _TOP_NAMES[key] if i is None else f"blk.{i}.{_LAYER_NAMES[key]}"

    heads = {"wq": cfg.num_heads, "bq": cfg.num_heads, "wk": cfg.num_kv_heads, "bk": cfg.num_kv_heads}

    def unpermute_qk(key: str, arr: np.ndarray) -> np.ndarray:
        return _unpermute(arr, heads[key]) if key in heads else arr

    permuted = gf.metadata["general.architecture"] == "llama"  # not gemma3/qwen2/qwen3
    return assemble(cfg, _GGUFSource(gf), tensor_name, dtype, fix=unpermute_qk if permuted else None)
