"""The params pytree the model code is written against, and the one function that fills it.

Layout: linear weights as [in, out] (HF's [out, in] transposed), per-layer tensors stacked on a
leading layer axis. Both checkpoint formats store linear weights as [out, in], so the formats only
say where each tensor is (`tensor_name`) and how to read it (`Source`); checking shapes, transposing
and stacking happen here, the same way for both.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from tokenmill.config import ModelConfig

from .errors import ModelLoadError

# Linear weights: stored [out, in] in checkpoints, kept [in, out] in params.
MATRICES = frozenset({"lm_head", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "router"})
# Mixture-of-experts weights, assembled by the format (from per-expert or fused tensors) straight
# into params orientation: w1 [E, 2, D, F] (gate, up), w2 [E, F, D], b1 [E, 2, F], b2 [E, D].
EXPERTS = frozenset({"w1", "w2", "b1", "b2"})
# Gemma RMSNorm scales x by (1 + w); params hold the effective multiplier 1 + w.
GEMMA_NORMS = frozenset(
    {"final_norm", "attn_norm", "post_attn_norm", "mlp_norm", "post_ffn_norm", "q_norm", "k_norm"}
)


# XLA's CPU client takes a host buffer aligned to this many bytes as it is (jax.device_put without a
# copy); numpy aligns only to 16. A copy of every weight costs ~1 ms/MiB of start-up in fresh pages.
HOST_ALIGNMENT = 64


def host_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised array whose data start on a HOST_ALIGNMENT boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + HOST_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % HOST_ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def param_shapes(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(top-level shapes, per-layer shapes without the layer axis), in params orientation."""
    d, v, f, hd = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    top = {"embed": (v, d), "final_norm": (d,)}
    if not cfg.tie_word_embeddings:
        top["lm_head"] = (d, v)
    layer = {"attn_norm": (d,), "wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d)}
    if cfg.attention_bias:
        layer |= {"bq": (q,), "bk": (kv,), "bv": (kv,)}
    if cfg.qk_norm:
        layer |= {"q_norm": (hd,), "k_norm": (hd,)}
    layer["mlp_norm"] = (d,)
    if cfg.family == "gemma3":
        layer |= {"post_attn_norm": (d,), "post_ffn_norm": (d,)}
    if cfg.o_proj_bias:
        layer["bo"] = (d,)
    if cfg.attention_sinks:
        layer["sinks"] = (cfg.num_heads,)
    if cfg.is_moe:
        e, fe = cfg.num_experts, cfg.moe_intermediate_size
        layer |= {"router": (d, e), "w1": (e, 2, d, fe), "w2": (e, fe, d)}
        if cfg.moe_bias:
            layer |= {"router_bias": (e,), "b1": (e, 2, fe), "b2": (e, d)}
    else:
        layer |= {"w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
    return top, layer


class Source(Protocol):
    """A checkpoint's tensors by their own names, in the checkpoint's orientation."""

    where: str  # the path, for messages

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The tensor's shape without reading it; None if absent. Raises for unreadable tensors."""

    def read(self, name: str) -> np.ndarray: ...


class Experts(Protocol):
    """A checkpoint's expert tensors (keys in EXPERTS) of one layer, in params orientation."""

    def check(self, key: str, layer: int, shape: tuple[int, ...]) -> None:
        """Raise ModelLoadError unless the tensors that make up `key` exist and fit `shape`."""

    def read(self, key: str, layer: int) -> np.ndarray: ...


TensorName = Callable[[str, "int | None"], str]  # (params key, layer index or None) -> source name
Fix = Callable[[str, np.ndarray], np.ndarray]  # (params key, source-oriented array) -> fixed array


def assemble(
    cfg: ModelConfig,
    source: Source,
    tensor_name: TensorName,
    dtype,
    *,
    norm_offset: float = 0.0,
    fix: Fix | None = None,
    experts: Experts | None = None,
    skip: frozenset[str] = frozenset(),
) -> dict:
    """Read every tensor the config calls for into a fresh params dict, but those of the keys in
    `skip` (checked, not read: the caller fills them its own way).

    Every tensor's presence and shape is checked before any is read, so a bad checkpoint fails in
    milliseconds instead of after minutes of dequantizing, and never yields a half-filled model.
    `norm_offset` is added to Gemma norm weights (1.0 for HF checkpoints, which store w).
    """
    dtype = np.dtype(dtype)
    top, layer = param_shapes(cfg)
    wanted = [(k, None, s) for k, s in top.items()]
    wanted += [(k, i, s) for i in range(cfg.num_layers) for k, s in layer.items()]
    for key, i, shape in wanted:
        if key in EXPERTS:
            if experts is None:
                raise ModelLoadError(f"{source.where}: mixture-of-experts weights are not supported in this format")
            experts.check(key, i, shape)
            continue
        name = tensor_name(key, i)
        expect = shape[::-1] if key in MATRICES else shape
        got = source.shape(name)
        if got is None:
            raise ModelLoadError(f"{source.where}: missing tensor {name!r} (needed for {cfg.architecture})")
        if tuple(got) != expect:
            experts = f", num_experts={cfg.num_experts}" if cfg.is_moe else ""
            raise ModelLoadError(
                f"{source.where}: tensor {name!r} has shape {tuple(got)}, but the model config "
                f"(hidden_size={cfg.hidden_size}, heads={cfg.num_heads}/{cfg.num_kv_heads}x{cfg.head_dim}, "
                f"intermediate_size={cfg.intermediate_size}, vocab_size={cfg.vocab_size}{experts}) needs {expect}"
            )

    offset = norm_offset if cfg.family == "gemma3" else 0.0

    def load(key: str, i: int | None) -> np.ndarray:
        if key in EXPERTS:
            return experts.read(key, i)
        arr = source.read(tensor_name(key, i))
        if fix is not None:
            arr = fix(key, arr)
        if offset and key in GEMMA_NORMS:
            arr = arr.astype(np.float32) + offset  # add in fp32: w is small, 1 + w rounds in bf16
        return arr.T if key in MATRICES else arr

    params: dict = {}
    for key in top:
        if key not in skip:
            params[key] = host_array(top[key], dtype)
            params[key][...] = load(key, None)
    stacked = {key: host_array((cfg.num_layers, *shape), dtype) for key, shape in layer.items() if key not in skip}
    for i in range(cfg.num_layers):
        for key in stacked:
            stacked[key][i] = load(key, i)  # converts dtype and lays out [in, out] in one copy
    params["layers"] = stacked
    return params
