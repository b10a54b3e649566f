"""Load-time quantization of a mixture-of-experts model's experts (`--expert-quantization`).

The experts hold almost all of an MoE model's weights, and each token reads only k of them, so
they are what is worth storing in 8 bits. Each layer's w1 [E, 2, D, F] and w2 [E, F, D] become
int8 or fp8 with one float32 scale per window of rows along the reduction axis (D for w1, F for
w2): the sub-channel layout `tokenmill.ops.moe.fused_moe` dequantizes tile by tile.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from tokenmill.model.loader import LoadedModel
from tokenmill.ops.quantization import quantize_windows

EXPERT_QUANTIZATIONS = {"int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}


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
