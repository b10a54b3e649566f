"""Rotary position embeddings (the "rotate half" layout of HF transformers)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> np.ndarray:
    """RoPE inverse frequencies [head_dim // 2], with the scaling schemes HF configs name."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if not scaling:
        return inv_freq.astype(np.float32)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv_freq = np.where(is_medium, smoothed, scaled)
    else:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3")
    return inv_freq.astype(np.float32)


def apply_rotary(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x: [T, heads, head_dim], positions: [T] → x rotated by position, same dtype."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos = jnp.cos(freqs)[:, None, :]
    sin = jnp.sin(freqs)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
