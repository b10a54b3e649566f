"""Zeros that cost no memory until written (lazy_zeros.cc), for the KV cache on CPU.

jnp.zeros writes every page of its result: for a KV cache of several GiB that is seconds of
start-up, paid again on every start. `zeros` returns the same values from a buffer whose pages are
mapped to the kernel's zero page until the engine first writes them. Only for a single-device
result; anything else (or a missing compiler) takes jnp.zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tokenmill.ops.cpu.build import LAZY_ZEROS, load


def zeros(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding) -> jax.Array:
    """An array of zeros with `sharding`; lazily mapped where the sharding is one CPU device."""
    devices = sharding.device_set
    on_one_cpu = len(devices) == 1 and next(iter(devices)).platform == "cpu"
    if not on_one_cpu or not load(LAZY_ZEROS):
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
    call = jax.ffi.ffi_call(LAZY_ZEROS.target, jax.ShapeDtypeStruct(shape, dtype))
    return jax.jit(call, out_shardings=sharding)()
