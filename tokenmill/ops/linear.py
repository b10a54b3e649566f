"""The linear layers of a model's stacked weights: y = x . w[layer], w float32 or 8-bit.

`w` is the [L, K, N] stack of every layer's weights (what the model's scan runs over) and `layer`
the index, traced inside the scan; 8-bit weights carry one scale per window of `wsz` rows and
column (`ops.quantization`). On CPU the C++ kernel (ops/cpu/linear.cc) computes it, reading the
layer in place and dequantizing as it goes (TOKENMILL_LINEAR_BACKEND); `linear_ref`, the jnp
reference, slices the layer, dequantizes it whole and lets XLA multiply.

Stacks may also be in the CPU kernel's strips ([L, N / 32, K, 32], `ops.cpu.linear.to_strips`; the
scales of 8-bit ones stay as they are), which it multiplies without repacking float32 ones on every
call and streams contiguously when decoding; `kernel_layout` converts a model's stack at load time
where the kernel will run.

`bf16=True` (`--quantization w8a16`) rounds x to bfloat16 before it meets the 8-bit weights: an
8-bit code is exactly a bfloat16, so the kernel multiplies with the CPU's bfloat16 dot products
where it has them, AMX tiles or AVX512-BF16 (ops/cpu/bf16_pack.h: each window's products summed in
float32, then scaled), else on the float32 path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tokenmill import envs
from tokenmill.distributed.mesh import is_unsharded
from tokenmill.ops.cpu import linear as cpu_linear
from tokenmill.ops.quantization import dequantize


def to_bf16_values(x: jax.Array) -> jax.Array:
    """x rounded to the nearest bfloat16 (ties to even), kept in float32."""
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def linear_ref(x: jax.Array, w: jax.Array, layer, scale: jax.Array | None = None, wsz: int | None = None,
               bf16: bool = False, offset: jax.Array | None = None) -> jax.Array:
    """x [M, K] . w[layer]: in x's dtype for unquantized w, else in float32 (→ f32[M, N]); `bf16`: x
    rounded to bfloat16 first."""
    if cpu_linear.is_uint4_strips(w):
        stored = cpu_linear.from_uint4_strips(w[layer])
    else:
        stored = cpu_linear.from_strips(w[layer]) if w.ndim == 4 else w[layer]
    if scale is None:
        return x @ stored
    weights = dequantize(stored, scale[layer], wsz, 0, jnp.float32, None if offset is None else offset[layer])
    x = to_bf16_values(x) if bf16 else x.astype(jnp.float32)
    return jnp.dot(x, weights, preferred_element_type=jnp.float32)


def in_features(w: jax.Array) -> int:
    """K, the reduction axis of the stack `w` ([L, K, N] or its strips, 4-bit ones too)."""
    return w.shape[2] if w.ndim == 4 else w.shape[1]


def kernel_runs(w: jax.Array, mesh: jax.sharding.Mesh) -> bool:
    """Whether `linear` will multiply the stack `w` ([L, K, N], or 4-bit strips) on the CPU kernel
    where it runs over `mesh`."""
    stack = (w.ndim == 3 and jnp.dtype(w.dtype) in cpu_linear.KERNEL_DTYPES) or cpu_linear.is_uint4_strips(w)
    return (
        envs.TOKENMILL_LINEAR_BACKEND != "jnp" and jax.default_backend() == "cpu" and is_unsharded(mesh)
        and stack and cpu_linear.available()
    )


def kernel_layout(w: jax.Array, mesh: jax.sharding.Mesh) -> jax.Array:
    """The [L, K, N] stack `w` in the layout `linear` multiplies fastest where it runs over `mesh`: the
    CPU kernel's strips (float32 or 8-bit weights; scales unchanged) where the kernel will compute
    them, else `w` itself."""
    return jax.jit(cpu_linear.to_strips)(w) if takes_strips(w, mesh) else w


def takes_strips(w, mesh: jax.sharding.Mesh) -> bool:
    """Whether `kernel_layout` puts the [L, K, N] stack `w` (an array or just its shape) in strips."""
    return kernel_runs(w, mesh) and w.ndim == 3 and w.shape[2] % cpu_linear.STRIP == 0


def _use_cpu_kernel(x, w, scale) -> bool:
    backend = envs.TOKENMILL_LINEAR_BACKEND
    if backend == "jnp":
        return False
    usable = cpu_linear.usable_for(x, w, scale)
    if backend == "cpu_kernel":
        if not usable:
            raise ValueError(
                "TOKENMILL_LINEAR_BACKEND=cpu_kernel computes float32 x with float32 weights, or int8 / float8 "
                f"weights with scales, only; got x {x.dtype}, w {w.dtype}"
            )
        return True
    # one opaque call cannot be partitioned: only where nothing is sharded
    unsharded = is_unsharded(jax.sharding.get_abstract_mesh())
    return jax.default_backend() == "cpu" and usable and unsharded and cpu_linear.available()


def linear(x: jax.Array, w: jax.Array, layer, scale: jax.Array | None = None, wsz: int | None = None,
           bf16: bool = False, offset: jax.Array | None = None) -> jax.Array:
    """x [M, K], w [L, K, N] or its strips [L, N / 32, K, 32] (scale [L, K / wsz, N] for 8-bit w)
    → [M, N] = x . w[layer] (float32 on the kernel and for 8-bit w, else x's dtype); `bf16`: x rounded
    to bfloat16 first (8-bit w only)."""
    if bf16 and (scale is None or offset is not None):
        raise ValueError("linear: bf16=True multiplies 8-bit weights (with their scales) only")
    if _use_cpu_kernel(x, w, scale):
        return cpu_linear.linear(x, w, layer, scale, wsz, bf16=bf16, offset=offset)
    return linear_ref(x, w, layer, scale, wsz, bf16, offset)
