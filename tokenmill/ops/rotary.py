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
    elif kind == "yarn":
        inv_freq = _yarn(inv_freq, head_dim, theta, scaling)
    else:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3, yarn")
    return inv_freq.astype(np.float32)


def _yarn(inv_freq: np.ndarray, head_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """YaRN: interpolate the low frequencies by `factor`, keep the high ones, ramp in between."""
    factor = scaling["factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over old_ctx
        return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """YaRN's factor on cos and sin (so on q and k: the attention scores scale by its square); 1 otherwise."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale(1.0)


def apply_rotary(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x: [T, heads, head_dim], positions: [T] → x rotated by position, same dtype."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos = jnp.cos(freqs)[:, None, :]
    sin = jnp.sin(freqs)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
