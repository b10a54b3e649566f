"""GGUF metadata -> an HF-style config dict, so GGUF and HF checkpoints share `ModelConfig.from_hf_dict`.

Matches what transformers builds from the same file (`AutoConfig.from_pretrained(dir, gguf_file=...)`,
via `GGUF_CONFIG_MAPPING` in transformers/integrations/ggml.py), plus what transformers leaves to
config-class defaults but a GGUF of another size would get wrong (noted where it happens).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .errors import ModelLoadError

GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # also Mistral, which llama.cpp stores as llama
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def gguf_arch(path: str, metadata: dict[str, Any]) -> str:
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported GGUF architectures: "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch


def gguf_to_hf_config(path: str, metadata: dict[str, Any], tensors: dict, rope_freqs=None) -> dict[str, Any]:
    """`tensors`: name -> info (only names are used). `rope_freqs`: the rope_freqs.weight tensor, if any."""
    arch = gguf_arch(path, metadata)

    def key(name: str, default: Any = KeyError) -> Any:
        full = f"{arch}.{name}"
        if full in metadata:
            return metadata[full]
        if default is KeyError:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {full!r}, which {arch} models need")
        return default

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    # head_dim: llama.cpp states it as key_length (gemma, qwen3) or rope.dimension_count (llama)
    head_dim = int(key("attention.key_length", 0) or key("rope.dimension_count", 0) or hidden // heads)
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else key("vocab_size")
    eos = [metadata.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    d: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 2048)),
        # llama.cpp writes output.weight only when the LM head is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        # llama.cpp stops on end-of-turn/message tokens too; the model config keeps all of them
        "eos_token_id": [int(e) for e in dict.fromkeys(eos) if e is not None],
    }
    scaling = _rope_scaling(path, arch, key, head_dim, d["rope_theta"], rope_freqs)
    if scaling:
        d["rope_scaling"] = scaling
    if arch == "gemma3":
        d["hidden_activation"] = "gelu_pytorch_tanh"
        d["sliding_window"] = int(key("attention.sliding_window", 512))
        d["sliding_window_pattern"] = 6  # llama.cpp hard-codes it for gemma3, as does HF's config
        d["rope_local_base_freq"] = 10000.0  # likewise: the sliding layers' RoPE base is not in the file
        # Attention scale. transformers leaves this at its config default (256, right for 270M-12B);
        # llama.cpp uses hidden/heads for the 27B (62 layers, head_dim 128) and head_dim otherwise.
        d["query_pre_attn_scalar"] = hidden // heads if d["num_hidden_layers"] == 62 else head_dim
    return d


def _rope_scaling(path, arch, key, head_dim, theta, rope_freqs) -> dict | None:
    kind = key("rope.scaling.type", None)
    if kind not in (None, "none"):
        factor = float(key("rope.scaling.factor", 1.0))
        scaling = {"rope_type": kind, "factor": factor}
        orig = key("rope.scaling.original_context_length", None)
        if orig:
            scaling["original_max_position_embeddings"] = int(orig)
        if kind not in ("linear", "yarn"):
            raise ModelLoadError(f"{path}: RoPE scaling {kind!r} is not supported (supported: linear, yarn)")
        if rope_freqs is not None:
            raise ModelLoadError(f"{path}: both rope.scaling.type and a rope_freqs tensor; not supported")
        return scaling
    if rope_freqs is None:
        return None
    # Llama 3.1+: llama.cpp bakes the "llama3" RoPE scaling into per-frequency divisors (rope_freqs)
    # instead of metadata. Recover the parameters, accepting them only if they reproduce the tensor.
    freqs = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    scaling = {"rope_type": "llama3", "factor": float(freqs.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if freqs.shape != (head_dim // 2,) or not np.allclose(_llama3_divisors(head_dim, theta, scaling), freqs, rtol=1e-3):
        raise ModelLoadError(
            f"{path}: the rope_freqs tensor does not match Llama 3 RoPE scaling (factor {freqs.max():g}, "
            "low/high frequency factors 1/4, original context 8192); other RoPE frequency tables are not supported"
        )
    return scaling


def _llama3_divisors(head_dim: int, theta: float, s: dict) -> np.ndarray:
    """What llama.cpp writes as rope_freqs for transformers' "llama3" RoPE scaling."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    orig, lo, hi, factor = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"], s["factor"]
    smooth = np.clip((orig / wavelen - lo) / (hi - lo), 0.0, 1.0)
    # high frequencies keep 1, low ones get `factor`, and the band between interpolates the inverse
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return inv_freq / scaled
