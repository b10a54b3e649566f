"""The C++ linear kernel (linear.cc), called through JAX's FFI: y = x . w[layer].

`w` is the [L, K, N] stack of every layer's weights and `layer` a traced index: inside the model's
scan, handing the kernel one layer's slice would make XLA copy it out of the stack on every step.
Float32 weights, or 8-bit ones (int8, float8 e4m3fn / e5m2) with one scale per window of `wsz` rows
and column, dequantized inside the kernel as they are packed. `bf16`: x is rounded to bfloat16 first
(then the products run on the CPU's bfloat16 dot products, AMX tiles or AVX512-BF16, where it
has them and TOKENMILL_CPU_BF16_DOT allows).

Weights multiply fastest in the kernel's own layout, `to_strips(w)`: [L, N / STRIP, K, STRIP], strips
of STRIP columns each stored K x STRIP (8-bit scales stay [L, K / wsz, N]), which the GEMM reads in
place where they are float32 (no per-call packing) and a GEMV streams contiguously. The model
converts its projections once at load time. 4-bit codes (GGUF's Q4_0 / Q4_1 blocks, kept by
`--quantization gguf`) exist in strips only, two per byte (`to_uint4_strips`), with a scale and an
offset per window: value = code * scale + offset.

Weights multiplied by x quantized to 16-bit integers (--quantization w8a16_int / gguf_int, int8_dot.h)
take their own layout, quad strips: int8 codes `to_int8_quads`, [L, N / STRIP, K / 4, STRIP, 4]
uint8, each strip's rows holding 4 consecutive k of every column, each code stored plus 128 (what the
CPU's unsigned-by-signed byte dot products, AVX512-VNNI's VPDPBUSD, multiply); 4-bit codes
`to_uint4_quads`, [L, N / STRIP, K / 8, STRIP, 4], each byte holding k and k + 4 in its nibbles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tokenmill import envs
from tokenmill.ops.cpu.build import LINEAR, build_error, load

STRIP = 32  # columns per strip: gemm.h's kStrip
QUAD = 4  # k per group of an int8 quad strip's bytes: int8_dot.h's kQuad
MAX_INT_WINDOW = 512  # the longest window of x's 16-bit integers whose sums fit int32: int8_dot.h's kMaxIntWindow
_F32 = jnp.dtype(jnp.float32)
_8BIT = {jnp.dtype(t) for t in (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)}
KERNEL_DTYPES = {_F32} | _8BIT  # the weight types the kernel multiplies


def available() -> bool:
    """Whether the kernel is built and registered (builds it on first call)."""
    return load(LINEAR)


def supported_dtypes(x: jax.Array, w: jax.Array, scale: jax.Array | None) -> bool:
    """The operand types gemm.h computes (also the MoE kernel's rule): float32 x with float32
    weights, or with 8-bit weights and their scales."""
    if jnp.dtype(x.dtype) != _F32:
        return False
    return jnp.dtype(w.dtype) in _8BIT if scale is not None else jnp.dtype(w.dtype) == _F32


def is_uint4_strips(w: jax.Array) -> bool:
    """Whether `w` holds 4-bit codes in strips, two per byte ([L, N / STRIP, K, STRIP / 2] uint8)."""
    return jnp.dtype(w.dtype) == jnp.uint8 and w.ndim == 4 and w.shape[3] == STRIP // 2


def is_quads(w: jax.Array) -> bool:
    """Whether `w` holds quad strips ([L, N / STRIP, rows, STRIP, 4] uint8): int8 codes (`to_int8_quads`),
    or 4-bit ones (`to_uint4_quads`, which come with offsets)."""
    return jnp.dtype(w.dtype) == jnp.uint8 and w.ndim == 5 and w.shape[3:] == (STRIP, QUAD)


def usable_for(x: jax.Array, w: jax.Array, scale: jax.Array | None) -> bool:
    """Whether the kernel computes these operands (assumes the platform is CPU)."""
    if is_uint4_strips(w) or is_quads(w):
        return x.ndim == 2 and jnp.dtype(x.dtype) == _F32 and scale is not None
    in_strips = w.ndim == 4 and w.shape[3] == STRIP
    return x.ndim == 2 and (w.ndim == 3 or in_strips) and supported_dtypes(x, w, scale)


def to_strips(w: jax.Array) -> jax.Array:
    """Matrices [..., K, N] (N a multiple of STRIP) → the kernels' layout [..., N / STRIP, K, STRIP]
    (also the MoE kernel's, for its experts)."""
    *lead, K, N = w.shape
    if N % STRIP:
        raise ValueError(f"to_strips: N={N} is not a multiple of {STRIP}")
    axes = tuple(range(len(lead)))
    return w.reshape(*lead, K, N // STRIP, STRIP).transpose(*axes, len(lead) + 1, len(lead), len(lead) + 2)


def from_strips(strips: jax.Array) -> jax.Array:
    """Strips [..., N / STRIP, K, STRIP] → the matrices [..., K, N] they hold."""
    *lead, S, K, _ = strips.shape
    axes = tuple(range(len(lead)))
    return strips.transpose(*axes, len(lead) + 1, len(lead), len(lead) + 2).reshape(*lead, K, S * STRIP)


def to_uint4_strips(codes: jax.Array) -> jax.Array:
    """4-bit codes [..., K, N] (values 0..15, N a multiple of STRIP) → the kernel's 4-bit strips
    [..., N / STRIP, K, STRIP / 2] uint8: byte j of a strip's row holds columns 2j (low nibble) and
    2j + 1 (high nibble)."""
    strips = to_strips(codes.astype(jnp.uint8))
    return strips[..., 0::2] | (strips[..., 1::2] << 4)


def from_uint4_strips(packed: jax.Array) -> jax.Array:
    """4-bit strips [..., N / STRIP, K, STRIP / 2] → the codes [..., K, N] they hold (uint8)."""
    pairs = jnp.stack([packed & 0x0F, packed >> 4], axis=-1)
    return from_strips(pairs.reshape(*packed.shape[:-1], STRIP))


def to_int8_quads(q: jax.Array) -> jax.Array:
    """int8 weights [..., K, N] (K a multiple of QUAD, N of STRIP) → quad strips [..., N / STRIP, K / QUAD,
    STRIP, QUAD] uint8: byte i of column j in row r of a strip is the code of k = QUAD * r + i, plus 128."""
    strips = to_strips(q)
    *lead, K, _ = strips.shape
    if K % QUAD:
        raise ValueError(f"to_int8_quads: K={K} is not a multiple of {QUAD}")
    quads = jnp.swapaxes(strips.reshape(*lead, K // QUAD, QUAD, STRIP), -1, -2)
    return jax.lax.bitcast_convert_type(quads.astype(jnp.int8), jnp.uint8) ^ jnp.uint8(0x80)


def from_int8_quads(quads: jax.Array) -> jax.Array:
    """Quad strips (`to_int8_quads`) → the int8 weights [..., K, N] they hold."""
    codes = jax.lax.bitcast_convert_type(quads ^ jnp.uint8(0x80), jnp.int8)
    *lead, R, _, _ = codes.shape
    return from_strips(jnp.swapaxes(codes, -1, -2).reshape(*lead, R * QUAD, STRIP))


def to_uint4_quads(codes: jax.Array) -> jax.Array:
    """4-bit codes [..., K, N] (values 0..15; K a multiple of 2 * QUAD, N of STRIP) → nibble quad strips
    [..., N / STRIP, K / 8, STRIP, QUAD] uint8: byte i of column j in row r of a strip holds k = 8r + i
    in its low nibble and k = 8r + 4 + i in its high one."""
    strips = to_strips(codes.astype(jnp.uint8))
    *lead, K, _ = strips.shape
    if K % (2 * QUAD):
        raise ValueError(f"to_uint4_quads: K={K} is not a multiple of {2 * QUAD}")
    halves = jnp.moveaxis(strips.reshape(*lead, K // (2 * QUAD), 2, QUAD, STRIP), -1, -2)  # [..., r, half, 32, 4]
    return halves[..., 0, :, :] | (halves[..., 1, :, :] << 4)


def from_uint4_quads(quads: jax.Array) -> jax.Array:
    """Nibble quad strips (`to_uint4_quads`) → the codes [..., K, N] they hold (uint8)."""
    halves = jnp.stack([quads & 0x0F, quads >> 4], axis=-3)  # [..., r, half, 32, 4]
    *lead, R, _, _, _ = halves.shape
    return from_strips(jnp.moveaxis(halves, -1, -2).reshape(*lead, R * 2 * QUAD, STRIP))


GATED = {"silu": 1, "swish": 1}  # activations the kernel applies to a gated product (linear.cc's `gated`)


def linear(x: jax.Array, w: jax.Array, layer, scale: jax.Array | None = None, wsz: int | None = None,
           bf16: bool = False, offset: jax.Array | None = None, rows=None, gated: str | None = None) -> jax.Array:
    """x f32[M, K], w [L, K, N] or its strips (`to_strips`), float32, or 8-bit with scale
    f32[L, K / wsz, N], or 4-bit strips (`to_uint4_strips`) with scale and offset
    f32[L, K / wsz, N], or quad strips (`to_int8_quads`, or `to_uint4_quads` with offsets: x quantized to
    16-bit integers per window) with scale → f32[M, N]; `bf16`: x rounded to bfloat16 first (8-bit w only);
    `rows` (traced int, default M): only x's first `rows` rows are multiplied, y's others are zeros;
    `gated` (a GATED activation, w a fused gate/up projection [.., K, 2I]): → f32[M, I] = act(x . gate) * (x . up)."""
    if not available():
        raise RuntimeError(f"the CPU linear kernel is unavailable: {build_error(LINEAR)}")
    if gated is not None and gated not in GATED:
        raise ValueError(f"linear: gated={gated!r} is not one of {sorted(GATED)}")
    none = jnp.zeros((0,), jnp.float32)
    scale = none if scale is None else scale.astype(jnp.float32)
    offset = none if offset is None else offset.astype(jnp.float32)
    n = w.shape[1] * STRIP if w.ndim >= 4 else w.shape[2]
    if gated is not None and n % 2:
        raise ValueError(f"linear: gated needs an even number of columns, got {n}")
    out = jax.ShapeDtypeStruct((x.shape[0], n // 2 if gated else n), jnp.float32)
    rows = x.shape[0] if rows is None else rows
    return jax.ffi.ffi_call(LINEAR.target, out)(
        x, w, scale, offset, jnp.asarray(layer, jnp.int32).reshape(()), jnp.asarray(rows, jnp.int32).reshape(()),
        wsz=np.int64(wsz or 0),
        bf16=np.int64(2 if bf16 and envs.TOKENMILL_CPU_BF16_DOT else int(bf16)),
        gated=np.int64(GATED[gated] if gated else 0),
    )
