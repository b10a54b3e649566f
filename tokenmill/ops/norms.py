"""RMSNorm, computed in float32 whatever the activation dtype (as HF does)."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) * weight over the last axis.

    `weight` is the effective multiplier: Gemma's `1 + w` convention is folded in at load time.
    """
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)
