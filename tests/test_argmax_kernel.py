"""The C++ argmax kernel (greedy sampling on CPU) against jnp.argmax: same ids, NaNs and ties included.

The kernel must build on the test machine: if it cannot, these tests fail (they never skip).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenmill.ops.cpu import argmax as cpu_argmax
from tokenmill.ops.cpu.build import ARGMAX, load


def both(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = jnp.asarray(x, jnp.float32)
    return np.asarray(jax.jit(cpu_argmax.argmax)(x)), np.asarray(jnp.argmax(x, axis=-1))


@pytest.mark.parametrize("rows", [1, 3, 64, 65])
@pytest.mark.parametrize("vocab", [1, 7, 16, 49, 1000, 49152])
def test_matches_jnp_argmax(rows, vocab):
    assert load(ARGMAX), "the argmax kernel did not build"
    x = np.random.default_rng(rows * 100_000 + vocab).standard_normal((rows, vocab)).astype(np.float32)
    got, ref = both(x)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, ref)


def test_ties_nans_and_infinities_follow_jnp():
    """Ties go to the first index, a NaN beats everything (the first NaN wins, even before +inf), and
    a row of -inf answers 0 — in the vector body and in the scalar tail of a row."""
    x = np.random.default_rng(0).standard_normal((8, 37)).astype(np.float32)
    x[0, [5, 20, 33]] = 9.0  # tie, first in the vector body
    x[1, [34, 36]] = 9.0  # tie in the tail
    x[2, 30] = np.inf
    x[2, 31] = np.nan  # NaN after +inf, in the body
    x[3, 35] = np.nan  # NaN in the tail only
    x[3, 2] = np.inf
    x[4, :] = -np.inf
    x[5, [0, 17]] = np.nan  # two NaNs: the first
    x[6, :] = 1.0  # all equal
    x[7, [3, 36]] = np.inf
    got, ref = both(x)
    np.testing.assert_array_equal(got, ref)
    assert list(got[:8]) == [5, 34, 31, 35, 0, 0, 0, 3]


def test_greedy_sampling_takes_the_kernel_on_cpu():
    x = jnp.zeros((2, 64), jnp.float32)
    assert cpu_argmax.usable_for(x)
    assert "tokenmill_argmax" in jax.jit(cpu_argmax.greedy_ids).lower(x).as_text()
    assert not cpu_argmax.usable_for(x.astype(jnp.bfloat16))  # other dtypes: jnp.argmax
    np.testing.assert_array_equal(np.asarray(cpu_argmax.greedy_ids(x.astype(jnp.bfloat16))), [0, 0])


@pytest.mark.parametrize("isa", ["portable", "avx2"])
def test_narrower_builds_match_jnp_argmax(monkeypatch, isa):
    """The build without AVX2 and the AVX2 one without AVX-512 (8-wide vectors) give the same ids."""
    from tokenmill.ops.cpu import build

    monkeypatch.setattr(build, "isa_flags", lambda: () if isa == "portable" else ("-mavx2", "-mfma"))
    kernel = build.Kernel(f"tokenmill_argmax_{isa}", ARGMAX.symbol, ARGMAX.source)
    assert load(kernel), build.build_error(kernel)
    x = np.random.default_rng(5).standard_normal((9, 1003)).astype(np.float32)
    x[1, 500] = np.nan
    x[2, [7, 900]] = 50.0
    call = jax.ffi.ffi_call(kernel.target, jax.ShapeDtypeStruct((9,), jnp.int32))
    np.testing.assert_array_equal(np.asarray(jax.jit(call)(jnp.asarray(x))), np.asarray(jnp.argmax(x, axis=-1)))
