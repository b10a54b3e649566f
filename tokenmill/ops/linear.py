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

`int16=True` (`--quantization w8a16_int`) quantizes x to 16-bit integers, per row and window of the
weights' `wsz`: each window's products are then exact integers, scaled by both steps into float32
(`int16_products`), for int8 weights and for 4-bit codes with offsets (`--quantization gguf_int`).
On CPU the kernel multiplies them with integer dot products (ops/cpu/int8_dot.h: AVX512-VNNI's
VPDPBUSD, each of x's integers split into two int8, else AVX2's VPMADDWD) from the stack in quad strips
(`ops.cpu.linear.to_int8_quads` / `to_uint4_quads`, made by `kernel_layout(..., int16=True)`). (x quantized to
8 bits alone, as llama.cpp's Q8_0 does, moved SmolLM2's greedy output off float32's on five of the
eight parity prompts, three to 22 tokens in, away from any near tie; perplexity +0.6%.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tokenmill import envs
from tokenmill.distributed.mesh import is_unsharded
from tokenmill.ops.activations import get_activation
from tokenmill.ops.cpu import linear as cpu_linear
from tokenmill.ops.quantization import dequantize

INT16_STEPS = 127 * 254  # x's largest integer per window: one that splits into two int8 (int8_dot.h)


def to_bf16_values(x: jax.Array) -> jax.Array:
    """x rounded to the nearest bfloat16 (ties to even), kept in float32."""
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def int16_products(x: jax.Array, q: jax.Array, scale: jax.Array, wsz: int, offset: jax.Array | None = None) -> jax.Array:
    """x [M, K] quantized to integers per row and window of `wsz` (step = max|x| / INT16_STEPS, or 1 for
    an all-zero window; x / step rounded to the nearest, ties to even), times integer weights q [K, N]
    (int8, or 4-bit codes with `offset`: value = code * scale + offset) with scales [K / wsz, N]: each
    window's products summed exactly in int32, then scaled by x's step times the weights' scale (plus
    x's step times the offset times the window's sum of x's integers) → f32[M, N]."""
    M, K = x.shape
    windows, N = K // wsz, q.shape[1]
    parts = x.astype(jnp.float32).reshape(M, windows, wsz)
    amax = jnp.max(jnp.abs(parts), axis=2, keepdims=True)
    step = jnp.where(amax > 0, amax / INT16_STEPS, 1.0)
    xq = jnp.clip(jnp.round(parts / step), -INT16_STEPS, INT16_STEPS).astype(jnp.int32)
    sums = jnp.einsum("mwk,wkn->mwn", xq, q.reshape(windows, wsz, N).astype(jnp.int32),
                      preferred_element_type=jnp.int32)
    terms = sums.astype(jnp.float32) * (step * scale[None])
    if offset is not None:
        terms = terms + jnp.sum(xq, axis=2, keepdims=True).astype(jnp.float32) * (step * offset[None])
    return jnp.sum(terms, axis=1)


def linear_ref(x: jax.Array, w: jax.Array, layer, scale: jax.Array | None = None, wsz: int | None = None,
               bf16: bool = False, offset: jax.Array | None = None, int16: bool = False) -> jax.Array:
    """x [M, K] . w[layer]: in x's dtype for unquantized w, else in float32 (→ f32[M, N]); `bf16`: x
    rounded to bfloat16 first; `int16`: x quantized to 16-bit integers (int8 w, or 4-bit codes with
    offsets)."""
    if int16:
        stored, quads = w[layer], cpu_linear.is_quads(w)
        if offset is None:
            codes = cpu_linear.from_int8_quads(stored) if quads else stored
            return int16_products(x, codes, scale[layer], wsz)
        codes = cpu_linear.from_uint4_quads(stored) if quads else cpu_linear.from_uint4_strips(stored)
        return int16_products(x, codes, scale[layer], wsz, offset[layer])
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
    """K, the reduction axis of the stack `w` ([L, K, N] or its strips, 4-bit ones too; not quad strips,
    whose rows hold 4 or 8 k)."""
    if cpu_linear.is_quads(w):
        raise ValueError("in_features: quad strips do not say whether their rows hold 4 or 8 k")
    return w.shape[2] if w.ndim == 4 else w.shape[1]


def kernel_runs(w: jax.Array, mesh: jax.sharding.Mesh) -> bool:
    """Whether `linear` will multiply the stack `w` ([L, K, N], or 4-bit strips) on the CPU kernel
    where it runs over `mesh`."""
    stack = (w.ndim == 3 and jnp.dtype(w.dtype) in cpu_linear.KERNEL_DTYPES) or cpu_linear.is_uint4_strips(w)
    return (
        envs.TOKENMILL_LINEAR_BACKEND != "jnp" and jax.default_backend() == "cpu" and is_unsharded(mesh)
        and stack and cpu_linear.available()
    )


def kernel_layout(w: jax.Array, mesh: jax.sharding.Mesh, int16: bool = False) -> jax.Array:
    """The [L, K, N] stack `w` in the layout `linear` multiplies fastest where it runs over `mesh`: the
    CPU kernel's strips (float32 or 8-bit weights; scales unchanged) where the kernel will compute
    them, its quad strips for int8 weights and 4-bit strips with `int16`, else `w` itself."""
    if int16 and cpu_linear.is_uint4_strips(w) and kernel_runs(w, mesh) and w.shape[2] % (2 * cpu_linear.QUAD) == 0:
        return jax.jit(lambda s: cpu_linear.to_uint4_quads(cpu_linear.from_uint4_strips(s)))(w)
    if not takes_strips(w, mesh):
        return w
    if int16 and jnp.dtype(w.dtype) == jnp.int8 and w.shape[1] % cpu_linear.QUAD == 0:
        return jax.jit(cpu_linear.to_int8_quads)(w)
    return jax.jit(cpu_linear.to_strips)(w)


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


def gate(y: jax.Array, act: str) -> jax.Array:
    """A gated MLP's hidden state from its fused gate/up product y [M, 2I]: act(y[:, :I]) * y[:, I:]."""
    half = y.shape[1] // 2
    return get_activation(act)(y[:, :half]) * y[:, half:]


def linear(x: jax.Array, w: jax.Array, layer, scale: jax.Array | None = None, wsz: int | None = None,
           bf16: bool = False, offset: jax.Array | None = None, int16: bool = False, rows=None,
           gated: str | None = None) -> jax.Array:
    """x [M, K], w [L, K, N] or its strips [L, N / 32, K, 32] (scale [L, K / wsz, N] for 8-bit w)
    → [M, N] = x . w[layer] (float32 on the kernel and for 8-bit w, else x's dtype); `bf16`: x rounded
    to bfloat16 first (8-bit w only); `int16`: x quantized to 16-bit integers per window (int8 w, 4-bit
    strips with offsets, or their quad strips); `rows` (traced int): x's rows from `rows` on are
    padding, whose products are unspecified (the CPU kernel skips them and writes zeros); `gated` (an
    activation; w a fused gate/up projection [L, K, 2I]): → [M, I] = `gate(x . w[layer], gated)`, which the
    CPU kernel applies in cache for SiLU."""
    if bf16 and (scale is None or offset is not None):
        raise ValueError("linear: bf16=True multiplies 8-bit weights (with their scales) only")
    quads = cpu_linear.is_quads(w)
    if quads and not int16:
        raise ValueError("linear: quad strips are multiplied with int16=True only")
    integers = quads or (
        (jnp.dtype(w.dtype) == jnp.int8 and w.ndim == 3 and offset is None)
        or (cpu_linear.is_uint4_strips(w) and offset is not None)
    )
    if int16 and (not integers or scale is None or bf16):
        raise ValueError("linear: int16=True multiplies int8 weights [L, K, N], 4-bit strips with offsets, or "
                         "their quad strips, with their scales (no bf16)")
    if (quads or not int16) and _use_cpu_kernel(x, w, scale) and (not quads or wsz <= cpu_linear.MAX_INT_WINDOW):
        if gated is None or gated in cpu_linear.GATED:
            return cpu_linear.linear(x, w, layer, scale, wsz, bf16=bf16, offset=offset, rows=rows, gated=gated)
        return gate(cpu_linear.linear(x, w, layer, scale, wsz, bf16=bf16, offset=offset, rows=rows), gated)
    y = linear_ref(x, w, layer, scale, wsz, bf16, offset, int16)
    return y if gated is None else gate(y, gated)
