"""--quantization w8a16_int: int8 weights times x quantized to 16-bit integers per window (ops.linear's
`int16`), and GGUF's 4-bit codes with their offsets (--quantization gguf_int), on the C++ kernel's
integer dot products (ops/cpu/int8_dot.h: AVX512-VNNI where the CPU has it, else AVX2, else a portable
loop)
against `linear_ref`, whose `int16_products` is the jnp oracle.

Row counts on both sides of the GEMV / GEMM switch (4 rows) and past a GEMM tile (6 rows) and a
row block, windows of 32 and 64, layer indices wrapped and clamped; the quad strips' layouts; batch
invariance; every build (the portable loop's, AVX2's, AVX512-VNNI's) giving the same bits; and bad
arguments refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenmill.ops.cpu import build
from tokenmill.ops.cpu import linear as cpu_linear
from tokenmill.ops.linear import INT16_STEPS, int16_products, kernel_layout, linear, linear_ref
from tokenmill.ops.quantization import quantize_windows

F32_REL = 1e-5


def require_kernel() -> None:
    assert cpu_linear.available(), f"the CPU linear kernel did not build: {build.build_error(build.LINEAR)}"


def int8_stack(seed: int, L: int, K: int, N: int, wsz: int):
    """Random weights quantized to int8 ([L, K, N], scales [L, K / wsz, N]) and their quad strips."""
    w = jnp.asarray(np.random.default_rng(seed).standard_normal((L, K, N)) / np.sqrt(K), jnp.float32)
    q, scale = jax.jit(quantize_windows, static_argnums=(1, 2, 3))(w, jnp.int8, wsz, 1)
    return q, scale, jax.jit(cpu_linear.to_int8_quads)(q)


def kernel_and_ref(monkeypatch, x, q, quads, scale, wsz, layer):
    monkeypatch.setenv("TOKENMILL_LINEAR_BACKEND", "cpu_kernel")
    kernel = np.asarray(jax.jit(lambda x: linear(x, quads, layer, scale, wsz, int16=True))(x))
    ref = np.asarray(jax.jit(lambda x: linear_ref(x, q, layer, scale, wsz, int16=True))(x))
    return kernel, ref


def test_quad_strips_hold_four_k_of_each_column_plus_128():
    q = jnp.asarray(np.random.default_rng(0).integers(-127, 128, (2, 16, 64)), jnp.int8)
    quads = cpu_linear.to_int8_quads(q)
    assert quads.shape == (2, 2, 4, 32, 4) and quads.dtype == jnp.uint8
    # layer 1, strip 1 (columns 32..63), row 2 (k = 8..11), column 5 of the strip, byte 3: k = 11
    assert int(quads[1, 1, 2, 5, 3]) == int(q[1, 11, 37]) + 128
    np.testing.assert_array_equal(np.asarray(cpu_linear.from_int8_quads(quads)), np.asarray(q))
    assert cpu_linear.is_quads(quads) and not cpu_linear.is_quads(cpu_linear.to_strips(q))
    with pytest.raises(ValueError, match="K=6 is not a multiple of 4"):
        cpu_linear.to_int8_quads(q[:, :6])


def test_the_reference_sums_each_window_exactly():
    """int16_products: x / (max|x| / INT16_STEPS) rounded per window, each window's products an exact
    integer, scaled by both steps."""
    rng = np.random.default_rng(1)
    K, N, wsz = 96, 40, 32
    x = rng.standard_normal((3, K)).astype(np.float32)
    x[1, :wsz] = 0.0  # an all-zero window
    q = rng.integers(-127, 128, (K, N)).astype(np.int8)
    scale = rng.uniform(0.01, 0.02, (K // wsz, N)).astype(np.float32)
    expected = np.zeros((3, N))
    for w in range(K // wsz):
        part = x[:, w * wsz:(w + 1) * wsz]
        amax = np.abs(part).max(axis=1, keepdims=True)
        step = np.where(amax > 0, amax / np.float32(INT16_STEPS), np.float32(1)).astype(np.float32)
        xq = np.round(part / step).astype(np.int64)
        assert np.abs(xq).max() <= INT16_STEPS
        expected += (xq @ q[w * wsz:(w + 1) * wsz].astype(np.int64)) * step * scale[w].astype(np.float64)
    got = np.asarray(int16_products(jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale), wsz))
    np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize("M", [1, 3, 4, 5, 13, 100, 300])
@pytest.mark.parametrize("K,N,wsz", [(320, 96, 32), (576, 1120, 64)])
def test_kernel_matches_reference(monkeypatch, M, K, N, wsz):
    require_kernel()
    q, scale, quads = int8_stack(M + N, 3, K, N, wsz)
    x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)), jnp.float32)
    kernel, ref = kernel_and_ref(monkeypatch, x, q, quads, scale, wsz, 2)
    assert np.max(np.abs(kernel - ref)) <= F32_REL * np.max(np.abs(ref))
    # and x was quantized: the float product of the same weights lands close, not on it
    floats = np.asarray(linear_ref(x, q, 2, scale, wsz))
    assert 0 < np.max(np.abs(kernel - floats)) <= 1e-4 * np.max(np.abs(floats))


@pytest.mark.parametrize("layer", [-1, -4, 3, 7])
def test_layer_index_wraps_then_clamps_like_jnp(monkeypatch, layer):
    require_kernel()
    q, scale, quads = int8_stack(5, 3, 128, 64, 32)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 128)), jnp.float32)
    kernel, ref = kernel_and_ref(monkeypatch, x, q, quads, scale, 32, layer)
    assert np.max(np.abs(kernel - ref)) <= F32_REL * np.max(np.abs(ref))


def test_a_row_does_not_depend_on_its_batch(monkeypatch):
    """Each output is one chain of window sums, whatever the rows beside it (GEMV, GEMM tiles)."""
    require_kernel()
    monkeypatch.setenv("TOKENMILL_LINEAR_BACKEND", "cpu_kernel")
    _, scale, quads = int8_stack(7, 2, 576, 1120, 64)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((260, 576)), jnp.float32)
    call = jax.jit(lambda x: linear(x, quads, 1, scale, 64, int16=True))
    full = np.asarray(call(x))
    for rows in (1, 3, 4, 5, 13, 100):
        np.testing.assert_array_equal(np.asarray(call(x[:rows])), full[:rows])



def test_padding_rows_are_skipped_and_zeroed(monkeypatch):
    """`rows`: the rows past it (a step's padding) are not quantized or multiplied, and come out zero."""
    require_kernel()
    monkeypatch.setenv("TOKENMILL_LINEAR_BACKEND", "cpu_kernel")
    _, scale, quads = int8_stack(13, 2, 576, 1120, 64)
    x = jnp.asarray(np.random.default_rng(14).standard_normal((300, 576)), jnp.float32)
    call = jax.jit(lambda x, rows: linear(x, quads, 1, scale, 64, int16=True, rows=rows))
    full = np.asarray(call(x, 300))
    for rows in (0, 1, 5, 13, 299):
        out = np.asarray(call(x.at[rows:].set(jnp.nan), rows))
        np.testing.assert_array_equal(out[:rows], full[:rows])
        assert not out[rows:].any()

def test_zero_and_outlier_windows(monkeypatch):
    """An all-zero window contributes nothing; a window with one large value keeps it (it sets the
    step) while values below half a step beside it round to zero."""
    require_kernel()
    q, scale, quads = int8_stack(9, 1, 64, 32, 32)
    x = np.zeros((2, 64), np.float32)
    x[1, 32] = 1000.0
    x[1, 33] = 0.01
    kernel, ref = kernel_and_ref(monkeypatch, jnp.asarray(x), q, quads, scale, 32, 0)
    np.testing.assert_array_equal(kernel[0], 0.0)
    expected = 1000.0 * np.asarray(q[0, 32], np.float64) * np.asarray(scale[0, 1], np.float64)
    np.testing.assert_allclose(kernel[1], expected, rtol=1e-6)
    np.testing.assert_allclose(ref, kernel, rtol=1e-6)


def test_windows_too_long_for_int32_sums_take_the_reference(monkeypatch):
    """Windows longer than MAX_INT_WINDOW (a model's per-column scales over a long reduction) would
    overflow the kernel's int32 sums: the reference computes them."""
    require_kernel()
    q, scale, quads = int8_stack(15, 1, 1024, 32, 1024)
    x = jnp.asarray(np.random.default_rng(16).standard_normal((2, 1024)), jnp.float32)
    kernel, ref = kernel_and_ref(monkeypatch, x, q, quads, scale, 1024, 0)
    np.testing.assert_array_equal(kernel, ref)


# the cases of the build comparison: (rows, K, N, window, 4-bit codes); rows on both sides of the GEMV /
# GEMM switch and past a tile; an int8 window of 512, whose sums of codes plus 128 pass int32 on AVX2
_BUILD_CASES = [(1, 576, 96, 64, False), (2, 576, 96, 64, False), (3, 576, 96, 64, False), (4, 576, 96, 64, False),
                (11, 576, 96, 64, False), (3, 1024, 64, 512, False), (1, 320, 64, 32, True), (5, 320, 64, 32, True),
                (13, 320, 64, 32, True),
                # full tiles, which the asm loops take (AVX2: 5 rows of int8 codes; VNNI: 6 rows of int8 or 4-bit
                # codes), over windows of 8 and 128 quads; windows of 24, whose pairs of q AVX2 reorders past its
                # 16-value vectors
                (13, 320, 64, 32, False), (12, 1024, 64, 512, False), (7, 96, 64, 24, False), (6, 96, 64, 24, True),
                # two blocks of rows (dot_gemm's 48 on VNNI, 40 on AVX2), each block's first tile fetching the
                # next strip
                (50, 576, 96, 64, False), (50, 320, 64, 32, True)]

# run in a process of its own: python -c _OTHER_BUILD <operands.npz> <the build's ISA flags>
_OTHER_BUILD = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from tokenmill.ops.cpu import build
build.isa_flags = lambda: tuple(sys.argv[2].split())
from tokenmill.ops.linear import linear
operands = np.load(sys.argv[1])
outputs = []
for case in range(int(operands["cases"])):
    x, w, scale, offset = (operands[f"{k}{case}"] for k in ("x", "w", "scale", "offset"))
    wsz = int(operands[f"wsz{case}"])
    offset = jnp.asarray(offset) if offset.size else None
    y = jax.jit(lambda x: linear(x, jnp.asarray(w), 0, jnp.asarray(scale), wsz, offset=offset, int16=True))(jnp.asarray(x))
    outputs.append(np.asarray(y).view(np.uint32).tolist())
print(json.dumps(outputs))
"""


def test_every_build_gives_the_same_bits(monkeypatch, tmp_path):
    """Integer sums are exact and the scaling is the same code on every build: this CPU's (AVX512-VNNI's
    byte dot products, or AVX2's 16-bit ones) computes the very outputs of the portable loop's build and
    of the AVX2 one. (Both with FMA: without it, the scaling's multiply-adds round twice, by design.)"""
    require_kernel()
    others = [flags for flags in ("-mfma", "-mavx2 -mfma") if flags != " ".join(build.isa_flags())]
    if not {"avx2", "fma"} <= build._cpu_flags():
        pytest.skip("this CPU cannot run the AVX2 build")
    monkeypatch.setenv("TOKENMILL_LINEAR_BACKEND", "cpu_kernel")
    operands, fast = {"cases": len(_BUILD_CASES)}, []
    for case, (M, K, N, wsz, nibbles) in enumerate(_BUILD_CASES):
        if nibbles:
            _, scale, offset, _, w = uint4_quads(40 + case, 1, K, N, wsz)
        else:
            _, scale, w = int8_stack(40 + case, 1, K, N, wsz)
            offset = None
        x = np.random.default_rng(case).standard_normal((M, K)).astype(np.float32)
        fast.append(np.asarray(jax.jit(lambda x: linear(x, w, 0, scale, wsz, offset=offset, int16=True))(jnp.asarray(x))))
        operands.update({f"x{case}": x, f"w{case}": np.asarray(w), f"scale{case}": np.asarray(scale),
                         f"offset{case}": np.zeros(0) if offset is None else np.asarray(offset), f"wsz{case}": wsz})
    np.savez(tmp_path / "operands.npz", **operands)
    env = {**os.environ, "TOKENMILL_LINEAR_BACKEND": "cpu_kernel", "JAX_PLATFORMS": "cpu"}
    for flags in others:
        out = subprocess.run([sys.executable, "-c", _OTHER_BUILD, str(tmp_path / "operands.npz"), flags], env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        other = json.loads(out.stdout.strip().splitlines()[-1])
        for case, expected in enumerate(fast):
            got = np.asarray(other[case], np.uint32).view(np.float32).reshape(expected.shape)
            np.testing.assert_array_equal(got, expected, err_msg=f"build {flags}, case {_BUILD_CASES[case]}")


def test_vnni_is_built_where_the_cpu_has_it():
    wanted = {"avx512f", "avx512_vnni", "avx512bw", "avx2", "fma"} <= build._cpu_flags()
    assert ("-mavx512vnni" in build.isa_flags()) == wanted
    assert len(set(build.isa_flags())) == len(build.isa_flags())


def test_quads_are_made_only_for_int8_inputs_where_the_kernel_runs(monkeypatch):
    require_kernel()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    w = jnp.zeros((2, 8, 64), jnp.int8)
    assert kernel_layout(w, mesh, int16=True).shape == (2, 2, 2, 32, 4)
    assert kernel_layout(w, mesh).shape == (2, 2, 8, 32)
    assert kernel_layout(w.astype(jnp.float32), mesh, int16=True).shape == (2, 2, 8, 32)
    monkeypatch.setenv("TOKENMILL_LINEAR_BACKEND", "jnp")
    assert kernel_layout(w, mesh, int16=True).shape == (2, 8, 64)


def test_the_jnp_backend_computes_int8_inputs_from_either_layout(monkeypatch):
    q, scale, quads = int8_stack(12, 2, 128, 64, 32)
    x = jnp.asarray(np.random.default_rng(13).standard_normal((3, 128)), jnp.float32)
    monkeypatch.setenv("TOKENMILL_LINEAR_BACKEND", "jnp")
    from_quads = np.asarray(jax.jit(lambda x: linear(x, quads, 1, scale, 32, int16=True))(x))
    from_stack = np.asarray(jax.jit(lambda x: linear(x, q, 1, scale, 32, int16=True))(x))
    np.testing.assert_array_equal(from_quads, from_stack)


def uint4_quads(seed: int, L: int, K: int, N: int, wsz: int):
    """Random 4-bit codes [L, K, N] with a scale and an offset per window (Q4_1-like), in the loader's
    4-bit strips and in nibble quad strips."""
    rng = np.random.default_rng(seed)
    codes = jnp.asarray(rng.integers(0, 16, (L, K, N)), jnp.uint8)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, (L, K // wsz, N)) / (8 * np.sqrt(K)), jnp.float32)
    offset = jnp.asarray(-8 * scale * rng.uniform(0.7, 1.3, scale.shape), jnp.float32)
    return codes, scale, offset, cpu_linear.to_uint4_strips(codes), jax.jit(cpu_linear.to_uint4_quads)(codes)


def test_nibble_quads_hold_k_and_k_plus_4_of_each_column():
    codes, _, _, strips, quads = uint4_quads(17, 2, 64, 64, 32)
    assert quads.shape == (2, 2, 8, 32, 4) and quads.dtype == jnp.uint8
    # layer 1, strip 1, row 3 (k = 24..31), column 7 of the strip, byte 2: k = 26 (low), 30 (high)
    assert int(quads[1, 1, 3, 7, 2]) == int(codes[1, 26, 39]) | (int(codes[1, 30, 39]) << 4)
    np.testing.assert_array_equal(np.asarray(cpu_linear.from_uint4_quads(quads)), np.asarray(codes))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    if cpu_linear.available():  # the loader's 4-bit strips become nibble quads where the kernel runs
        np.testing.assert_array_equal(np.asarray(kernel_layout(strips, mesh, int16=True)), np.asarray(quads))
    assert kernel_layout(strips, mesh).shape == strips.shape


@pytest.mark.parametrize("M", [1, 4, 5, 13, 100])
def test_4bit_codes_match_reference(monkeypatch, M):
    """--quantization gguf_int: GGUF's Q4_0 / Q4_1 codes (value = code * scale + offset) times x's
    16-bit integers, from nibble quads, against the reference from the loader's 4-bit strips."""
    require_kernel()
    K, N, wsz = 320, 224, 32
    codes, scale, offset, strips, quads = uint4_quads(M, 3, K, N, wsz)
    x = jnp.asarray(np.random.default_rng(30 + M).standard_normal((M, K)), jnp.float32)
    monkeypatch.setenv("TOKENMILL_LINEAR_BACKEND", "cpu_kernel")
    kernel = np.asarray(jax.jit(lambda x: linear(x, quads, 2, scale, wsz, offset=offset, int16=True))(x))
    ref = np.asarray(jax.jit(lambda x: linear_ref(x, strips, 2, scale, wsz, offset=offset, int16=True))(x))
    assert np.max(np.abs(kernel - ref)) <= F32_REL * np.max(np.abs(ref))
    floats = np.asarray(linear_ref(x, strips, 2, scale, wsz, offset=offset))
    assert 0 < np.max(np.abs(kernel - floats)) <= 1e-4 * np.max(np.abs(floats))
    alone = np.asarray(jax.jit(lambda x: linear(x, quads, 2, scale, wsz, offset=offset, int16=True))(x[:1]))
    np.testing.assert_array_equal(alone, kernel[:1])


def test_bad_arguments_are_refused():
    q, scale, quads = int8_stack(14, 1, 64, 32, 32)
    x = jnp.zeros((1, 64), jnp.float32)
    with pytest.raises(ValueError, match="quad strips are multiplied with int16=True only"):
        linear(x, quads, 0, scale, 32)
    with pytest.raises(ValueError, match="int16=True multiplies int8 weights"):
        linear(x, q, 0, scale, 32, offset=scale, int16=True)
    with pytest.raises(ValueError, match="int16=True multiplies int8 weights"):
        linear(x, q.astype(jnp.float32), 0, int16=True)
    with pytest.raises(ValueError, match="int16=True multiplies int8 weights"):
        linear(x, quads, 0, scale, 32, bf16=True, int16=True)
