"""The C++ expert-FFN kernel of the fused MoE op (moe_experts.cc), called through JAX's FFI.

`moe_experts` takes the routed assignments already grouped by expert (`ops.moe.expert_groups`) and
returns the weighted sum of the expert outputs, float32 [T, D]. It reads each expert's weights in
place from the stacked arrays, which is what XLA:CPU's per-expert dots cannot do. It handles
float32 tokens with float32 experts, or with int8 / float8 (e4m3fn, e5m2) experts and their window
scales, which it dequantizes panel by panel as it packs them; everything else (fp4 experts, other
token dtypes) takes the jnp path of `ops.moe`, which is also the kernel's test oracle.

The call is per device: under expert parallelism `ops.moe` calls it inside its own shard_map, on
the experts of one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tokenmill.ops.cpu.build import MOE_EXPERTS, build_error, load
from tokenmill.ops.cpu.linear import STRIP, supported_dtypes

# the activation codes of moe_experts.cc
ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_pytorch_tanh": 2, "swigluoai": 3}


def available() -> bool:
    """Whether the kernel is built and registered (builds it on first call)."""
    return load(MOE_EXPERTS)


def usable_for(tokens: jax.Array, w1: jax.Array, w2: jax.Array, w1_scale: jax.Array | None) -> bool:
    """Whether the kernel computes these operands (assumes the platform is CPU): float32 tokens with
    float32 experts, or with 8-bit experts and their scales."""
    return jnp.dtype(w2.dtype) == jnp.dtype(w1.dtype) and supported_dtypes(tokens, w1, w1_scale)


def moe_experts(
    tokens, w1, w2, b1, b2, sorted_token, sorted_weight, group_begin, *, act_fn: str, alpha: float, limit: float,
    w1_scale=None, w2_scale=None, wsz: int | None = None,
) -> jax.Array:
    """tokens f32[T, D], w1 [E, 2, D, F], w2 [E, F, D] (float32, or 8-bit with w1_scale
    [E, 2, D / wsz, F] and w2_scale [E, F / wsz, D]), b1 [E, 2, F] | None, b2 [E, D] | None; the
    assignments sorted by expert: sorted_token i32[A], sorted_weight f32[A], and group_begin
    i32[E + 1] (local expert e owns sorted rows group_begin[e] .. group_begin[e + 1]) → f32[T, D]."""
    if not available():
        raise RuntimeError(f"the CPU MoE kernel is unavailable: {build_error(MOE_EXPERTS)}")
    num_experts = w1.shape[0]
    inter = w1.shape[2] * STRIP if w1.ndim == 5 else w1.shape[3]
    hidden = tokens.shape[1]
    b1 = jnp.zeros((num_experts, 2, inter), jnp.float32) if b1 is None else b1.astype(jnp.float32)
    b2 = jnp.zeros((num_experts, hidden), jnp.float32) if b2 is None else b2.astype(jnp.float32)
    no_scale = jnp.zeros((0,), jnp.float32)
    w1_scale = no_scale if w1_scale is None else w1_scale.astype(jnp.float32)
    w2_scale = no_scale if w2_scale is None else w2_scale.astype(jnp.float32)
    return jax.ffi.ffi_call(MOE_EXPERTS.target, jax.ShapeDtypeStruct(tokens.shape, jnp.float32))(
        tokens, w1, w2, w1_scale, w2_scale, b1, b2,
        sorted_token.astype(jnp.int32), sorted_weight.astype(jnp.float32), group_begin.astype(jnp.int32),
        act=np.int32(ACTIVATION_CODES[act_fn]), alpha=np.float32(alpha), limit=np.float32(limit),
        wsz=np.int64(wsz or 0),
    )
