"""Load-time quantization: a mixture-of-experts model's experts (`--expert-quantization`), or a
model's dense projections and LM head (`--quantization`).

The experts hold almost all of an MoE model's weights, and each token reads only k of them, so
they are what is worth storing in 8 bits. Each layer's w1 [E, 2, D, F] and w2 [E, F, D] become
int8 or fp8 with one float32 scale per window of rows along the reduction axis (D for w1, F for
w2): the sub-channel layout `tokenmill.ops.moe.fused_moe` dequantizes tile by tile.

`--quantization` stores the attention and MLP projections of every layer and the LM head in the
same layout, one scale per LINEAR_WINDOW rows of the reduction axis (per output column when that
does not divide every reduction axis of the model), for `tokenmill.ops.linear.linear`, which reads a layer in place and
dequantizes as it multiplies: a decode step reads a quarter of the bytes. The embedding table
stays float32 for the lookup (a tied LM head gets its own quantized copy). `w8a16` stores the same
int8 weights and rounds each projection's input to bfloat16 (`ops.linear`): the products then run
with a CPU's bfloat16 dot products (AMX, AVX512-BF16) where it has them; `w8a16_int` stores them too
and quantizes each projection's input to 16-bit integers per window, for integer dot products
(AVX512-VNNI's, else AVX2's). (`gguf` quantizes nothing: the loader keeps a GGUF file's
Q8_0 / Q4_0 / Q4_1 blocks as they are, loader/gguf_blocks.py.)
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from tokenmill.model.loader import LoadedModel
from tokenmill.ops.quantization import quantize_windows

EXPERT_QUANTIZATIONS = {"int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
# --quantization takes the same formats, plus int8 weights with bfloat16 inputs or 16-bit integer ones
QUANTIZATIONS = {**EXPERT_QUANTIZATIONS, "w8a16": jnp.int8, "w8a16_int": jnp.int8}
LINEAR_WINDOW = 64  # rows per scale (llama.cpp's Q8_0 blocks hold 32)
# --quantization gguf: no quantizing at all, a GGUF file's own blocks kept (loader/gguf_blocks.py)
KEEP_GGUF_BLOCKS = "gguf"
# the same blocks, multiplied by inputs quantized to 16-bit integers (as w8a16_int's)
KEEP_GGUF_BLOCKS_INT = "gguf_int"


def quantize_experts(model: LoadedModel, kind: str, window: int) -> LoadedModel:
    """A copy of `model` whose expert weights are quantized; raises ValueError for bad options."""
    cfg = model.config
    if kind not in EXPERT_QUANTIZATIONS:
        raise ValueError(f"expert_quantization must be one of {', '.join(EXPERT_QUANTIZATIONS)}, got {kind!r}")
    if not cfg.is_moe:
        raise ValueError(f"expert_quantization={kind!r} needs a mixture-of-experts model; {cfg.architecture} has no experts")
    if window <= 0 or cfg.hidden_size % window or cfg.moe_intermediate_size % window:
        raise ValueError(
            f"expert_quantization_window={window} must divide hidden_size ({cfg.hidden_size}) and the "
            f"experts' intermediate size ({cfg.moe_intermediate_size})"
        )
    dtype = EXPERT_QUANTIZATIONS[kind]
    layers = dict(model.params["layers"])
    for key, axis in (("w1", 2), ("w2", 1)):  # reduction axis of one layer's [E, 2, D, F] / [E, F, D]
        pairs = [quantize_windows(jnp.asarray(w), dtype, window, axis) for w in layers[key]]
        layers[key] = np.stack([np.asarray(q) for q, _ in pairs])  # one layer at a time bounds the peak
        layers[key + "_scale"] = np.stack([np.asarray(s, np.float32) for _, s in pairs])
    config = dataclasses.replace(cfg, expert_quantization=kind, expert_quant_window=window)
    return dataclasses.replace(model, config=config, params={**model.params, "layers": layers})


def quantize_linear_layers(model: LoadedModel, kind: str) -> LoadedModel:
    """A copy of `model` whose dense projections and LM head are quantized; ValueError for bad options."""
    from tokenmill.config import LLAMA_FAMILY
    from tokenmill.model.llama import LINEAR_WEIGHTS

    cfg = model.config
    if kind in (KEEP_GGUF_BLOCKS, KEEP_GGUF_BLOCKS_INT):
        raise ValueError(f"quantization={kind!r} keeps a GGUF file's blocks as the model loads (load_model's "
                         f"keep_gguf_blocks); {model.source} was loaded without them")
    if kind not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, {KEEP_GGUF_BLOCKS} or "
                         f"{KEEP_GGUF_BLOCKS_INT}, got {kind!r}")
    if cfg.architecture not in LLAMA_FAMILY:
        raise ValueError(f"quantization={kind!r} is implemented for the Llama family; {cfg.architecture} is not")
    if cfg.quantization:
        raise ValueError(f"the model is quantized already ({cfg.quantization})")
    # one window for the whole model (the forward takes it as a static value); 0: one scale per column
    reductions = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
    window = LINEAR_WINDOW if all(k % LINEAR_WINDOW == 0 for k in reductions if k) else 0
    if kind == "w8a16_int" and not window:
        raise ValueError(f"quantization={kind!r} needs reduction axes that are multiples of {LINEAR_WINDOW} "
                         f"(its integer sums run per window); {cfg.architecture}'s are {reductions}")
    dtype = QUANTIZATIONS[kind]
    layers = dict(model.params["layers"])
    for key in LINEAR_WEIGHTS:
        if key not in layers:  # an MoE model has no dense MLP
            continue
        pairs = [quantize_windows(jnp.asarray(w, jnp.float32), dtype, window or w.shape[0], 0) for w in layers[key]]
        layers[key] = np.stack([np.asarray(q) for q, _ in pairs])  # one layer at a time bounds the peak
        layers[key + "_scale"] = np.stack([np.asarray(s, np.float32) for _, s in pairs])
    params = {k: v for k, v in model.params.items() if k != "lm_head"}
    head = np.asarray(model.params["embed"]).T if cfg.tie_word_embeddings else np.asarray(model.params["lm_head"])
    q, scale = quantize_windows(jnp.asarray(head[None], jnp.float32), dtype, window or head.shape[0], 1)
    params.update(layers=layers, lm_head_q=np.asarray(q), lm_head_q_scale=np.asarray(scale, np.float32))
    config = dataclasses.replace(cfg, quantization=kind, quant_window=window)
    return dataclasses.replace(model, config=config, params=params)
