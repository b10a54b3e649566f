"""C++ kernels for XLA:CPU, called through JAX's FFI and compiled on first use (see build.py).

`paged_attention` here has the signature and semantics of `tokenmill.ops.attention.paged_attention_ref`
and reads K/V in place from the full cache: the traced layer index and the (possibly traced,
per-layer) sliding window are operands of the call, not Python values.

Sharding: the kernel is one opaque custom call, so XLA cannot split it by itself. When a mesh
with a "model" axis of size > 1 is set for tracing (`jax.set_mesh(mesh)`), the call is wrapped in
`shard_map` over that axis: each shard runs on its own kv heads (and their query heads), which
is exact since kv heads are independent. Without a mesh in context XLA runs the call replicated,
i.e. it gathers a sharded cache first; `usable_for` therefore declines multi-device processes
that set no mesh, and the `auto` backend falls back to the reference there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from tokenmill.ops.cpu.build import PAGED_ATTENTION, build_error, load

__all__ = ["available", "build_error", "paged_attention", "usable_for"]

_NO_WINDOW = int(np.iinfo(np.int32).max)  # reaches every position: no window
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_CACHE_DTYPES = (*_DTYPES, jnp.dtype(jnp.uint16))  # uint16: bfloat16 bits (attention.BFLOAT16_BITS)
_MODEL_AXIS = "model"


def available() -> bool:
    """Whether the paged-attention kernel is built and registered (builds it on first call)."""
    return load(PAGED_ATTENTION)


def _model_axis_size() -> int:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or _MODEL_AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[_MODEL_AXIS]


def usable_for(q: jax.Array, k_cache: jax.Array) -> bool:
    """Whether `auto` should take the kernel for these operands (assumes the platform is CPU)."""
    if jnp.dtype(q.dtype) not in _DTYPES or jnp.dtype(k_cache.dtype) not in _CACHE_DTYPES:
        return False
    if q.ndim != 3 or k_cache.ndim != 5 or q.shape[1] % k_cache.shape[3] or q.shape[2] != k_cache.shape[4]:
        return False
    if jax.sharding.get_abstract_mesh().empty:
        return jax.device_count() == 1  # several devices and no mesh: the inputs may be sharded
    return k_cache.shape[3] % _model_axis_size() == 0


def _call(q, k_cache, v_cache, layer, window, positions, token_request, block_tables, sinks, *, scale):
    return jax.ffi.ffi_call(PAGED_ATTENTION.target, jax.ShapeDtypeStruct(q.shape, q.dtype))(
        q, k_cache, v_cache, layer, window, positions, token_request, block_tables, sinks, scale=np.float32(scale)
    )


def paged_attention(q, k_cache, v_cache, layer, md, *, scale: float, sliding_window=None, sinks=None) -> jax.Array:
    """q: [T, heads, head_dim] → [T, heads, head_dim], as `paged_attention_ref`. Raises if the kernel
    could not be built."""
    if not available():
        raise RuntimeError(f"the CPU paged-attention kernel is unavailable: {build_error()}")
    window = _NO_WINDOW if sliding_window is None else sliding_window
    sinks = jnp.full((q.shape[1],), -jnp.inf, jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32)
    args = (
        q,
        k_cache,
        v_cache,
        jnp.asarray(layer, jnp.int32).reshape(()),
        jnp.asarray(window, jnp.int32).reshape(()),
        jnp.asarray(md.positions, jnp.int32),
        jnp.asarray(md.token_request, jnp.int32),
        jnp.asarray(md.block_tables, jnp.int32),
        sinks,
    )
    fn = lambda *a: _call(*a, scale=scale)  # noqa: E731
    if _model_axis_size() > 1:
        heads = P(None, _MODEL_AXIS, None)
        cache = P(None, None, None, _MODEL_AXIS, None)
        fn = jax.shard_map(
            fn, in_specs=(heads, cache, cache, P(), P(), P(), P(), P(), P(_MODEL_AXIS)), out_specs=heads,
            check_vma=False,
        )
    return fn(*args)
