"""Symmetric sub-channel quantization: one float32 scale per window of rows along the reduction axis.
(GGUF's Q4_1 blocks, kept as they are, add an offset per window: `dequantize`'s `offset`.)

The layout the fused MoE op and the linear layers share: 8-bit weights (int8, float8 e4m3fn / e5m2;
fp4 e2m1 for MoE experts) with scale = absmax / qmax over each window of `wsz` consecutive entries
of the reduction axis, for every other index. The C++ kernels (ops/cpu) decode the same layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _quant_max(dtype) -> float:
    """The largest magnitude a quantized value takes: 127 for int8, the finfo max for the floats."""
    if jnp.issubdtype(dtype, jnp.integer):
        return float(jnp.iinfo(dtype).max)
    return float(jnp.finfo(dtype).max)


def quantize_windows(w: jax.Array, dtype, wsz: int, reduction_axis: int) -> tuple[jax.Array, jax.Array]:
    """Symmetric sub-channel quantization: one float32 scale (absmax / qmax) per window of `wsz`
    consecutive entries along `reduction_axis`. w1 [E, 2, D, F] takes axis 2 (scale [E, 2, D // wsz, F]),
    w2 [E, F, D] axis 1 (scale [E, F // wsz, D])."""
    axis = reduction_axis % w.ndim
    if wsz <= 0 or w.shape[axis] % wsz:
        raise ValueError(f"wsz={wsz} does not divide the reduction dimension {w.shape[axis]}")
    windows = w.astype(jnp.float32).reshape(w.shape[:axis] + (w.shape[axis] // wsz, wsz) + w.shape[axis + 1 :])
    absmax = jnp.max(jnp.abs(windows), axis=axis + 1, keepdims=True)
    # an all-zero window keeps scale 1 so that dividing by it stays finite
    scale = jnp.where(absmax > 0, absmax / _quant_max(dtype), 1.0)
    scaled = windows / scale
    if jnp.issubdtype(dtype, jnp.integer):
        scaled = jnp.clip(jnp.round(scaled), -_quant_max(dtype), _quant_max(dtype))
    return scaled.astype(dtype).reshape(w.shape), jnp.squeeze(scale, axis + 1)


def dequantize(q: jax.Array, scale: jax.Array | None, wsz: int | None, reduction_axis: int, dtype,
               offset: jax.Array | None = None) -> jax.Array:
    """q with its window scales applied (q * scale, plus `offset` per window where given: GGUF's
    Q4_1 blocks), in `dtype` (q itself, cast, when there are no scales)."""
    if scale is None:
        return q.astype(dtype)
    axis = reduction_axis % q.ndim
    windows = q.astype(jnp.float32).reshape(q.shape[:axis] + (q.shape[axis] // wsz, wsz) + q.shape[axis + 1 :])
    values = windows * jnp.expand_dims(scale, axis + 1)
    if offset is not None:
        values = values + jnp.expand_dims(offset, axis + 1)
    return values.reshape(q.shape).astype(dtype)
