"""The C++ linear kernel (ops/cpu/linear.cc) against `linear_ref`, its jnp oracle: y = x . w[layer].

Row counts on both sides of the GEMV / packed-GEMM switch (4 rows) and past a row block, column
counts that are not multiples of a pass (64 / 32 columns), reductions longer than a packed panel,
negative and out-of-range layer indices (jnp's wrap-then-clamp), float32 and 8-bit weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenmill.ops.cpu import build
from tokenmill.ops.cpu import linear as cpu_linear
from tokenmill.ops.linear import linear, linear_ref
from tokenmill.ops.quantization import quantize_windows

F32_REL = 1e-5


def require_kernel() -> None:
    assert cpu_linear.available(), f"the CPU linear kernel did not build: {build.build_error(build.LINEAR)}"


def stack(seed: int, L: int, K: int, N: int, dtype, wsz: int | None):
    w = jnp.asarray(np.random.default_rng(seed).standard_normal((L, K, N)) / np.sqrt(K), jnp.float32)
    if dtype == jnp.float32:
        return w, None
    return jax.jit(quantize_windows, static_argnums=(1, 2, 3))(w, dtype, wsz, 1)


def both(monkeypatch, x, w, layer, scale, wsz):
    monkeypatch.setenv("TOKENMILL_LINEAR_BACKEND", "cpu_kernel")
    kernel = np.asarray(jax.jit(lambda x, w, s: linear(x, w, layer, s, wsz))(x, w, scale))
    ref = np.asarray(jax.jit(lambda x, w, s: linear_ref(x, w, layer, s, wsz))(x, w, scale))
    return kernel, ref


@pytest.mark.parametrize("M", [1, 3, 4, 5, 13, 150])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_kernel_matches_reference(monkeypatch, M, dtype):
    require_kernel()
    K, N, wsz = 300, 200, 20
    w, scale = stack(M, 3, K, N, dtype, wsz)
    x = jnp.asarray(np.random.default_rng(100 + M).standard_normal((M, K)), jnp.float32)
    kernel, ref = both(monkeypatch, x, w, 1, scale, wsz if scale is not None else None)
    assert np.max(np.abs(kernel - ref)) <= F32_REL * np.max(np.abs(ref))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8])
def test_a_row_does_not_depend_on_its_batch(monkeypatch, dtype):
    """The GEMV (up to 4 rows) and the packed GEMM run the same FMA chain per output: a row's result
    is bit for bit the same alone or among 150 rows (what keeps greedy output batch-invariant)."""
    require_kernel()
    monkeypatch.setenv("TOKENMILL_LINEAR_BACKEND", "cpu_kernel")
    w, scale = stack(9, 2, 300, 200, dtype, 20)
    wsz = 20 if scale is not None else None
    x = jnp.asarray(np.random.default_rng(10).standard_normal((150, 300)), jnp.float32)
    call = jax.jit(lambda x: linear(x, w, 1, scale, wsz))
    full = np.asarray(call(x))
    for rows in (1, 3, 4, 5, 13):
        np.testing.assert_array_equal(np.asarray(call(x[:rows])), full[:rows])


@pytest.mark.parametrize("layer", [-1, 7, -9])
def test_layer_index_wraps_then_clamps_like_jnp(monkeypatch, layer):
    require_kernel()
    w, scale = stack(5, 3, 64, 128, jnp.int8, 64)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 64)), jnp.float32)
    kernel, ref = both(monkeypatch, x, w, layer, scale, 64)
    np.testing.assert_allclose(kernel, ref, rtol=1e-5, atol=1e-5)


def test_int8_is_close_to_float32():
    """Per-window int8 keeps ~7 bits of each window's absmax: the product moves by about a percent."""
    w, _ = stack(7, 1, 256, 96, jnp.float32, None)
    q, scale = stack(7, 1, 256, 96, jnp.int8, 64)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((4, 256)), jnp.float32)
    exact, approx = np.asarray(linear_ref(x, w, 0)), np.asarray(linear_ref(x, q, 0, scale, 64))
    assert np.linalg.norm(approx - exact) <= 0.02 * np.linalg.norm(exact)


def test_forcing_the_kernel_on_unsupported_weights_is_refused(monkeypatch):
    monkeypatch.setenv("TOKENMILL_LINEAR_BACKEND", "cpu_kernel")
    w = jnp.zeros((1, 8, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="TOKENMILL_LINEAR_BACKEND=cpu_kernel"):
        linear(jnp.zeros((1, 8), jnp.float32), w, 0)
