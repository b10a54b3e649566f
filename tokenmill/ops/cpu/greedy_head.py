"""A greedy step's LM head by the C++ kernel (greedy_head.cc): logits whose argmax is exactly the
float32 head's, reading an int8 copy of the head instead of the float32 one where it can.

Decoding one stream is bound by the bytes it reads per token, and a float32 head is a fifth of them
(SmolLM2: 113 of 540 MB). `screen_head` makes, once at load time, an int8 copy of the head (one scale per
column) and per column a bound c_v on how far the copy's logit can be from the float32 one, |x|_2 * c_v.
`greedy_logits` then screens each row through the copy and computes the float32 logit (the same bits as
`ops.cpu.linear`'s) only of the columns that could hold the row's maximum; the others come out below
it. So the argmax, and with it greedy decoding, is exactly the float32 head's; the other values are not
logits, so only a step that takes nothing but the argmax may use them (the sampler's "greedy" mode with
no logprobs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tokenmill.ops.cpu.build import GREEDY_HEAD, SCREEN_HEAD, load
from tokenmill.ops.cpu.linear import STRIP
from tokenmill.ops.quantization import dequantize, quantize_windows

# rows the kernel screens at most (gemm.h's kGemvRows): at 5 and 8 rows two passes over the int8 copy,
# bound by converting its codes, took longer than the float32 GEMV over the whole head (3.4 / 4.9 ms
# against 2.9 / 3.3 on SmolLM2, Zen 4)
MAX_ROWS = 4
_U = 2.0**-24  # float32's unit roundoff
_SLACK = 1e-3  # c_v's relative margin for the float32 arithmetic of the bound itself


def available() -> bool:
    """Whether the kernel is built and registered (builds it on first call)."""
    return load(GREEDY_HEAD)


def screen_head(strips: jax.Array) -> dict[str, jax.Array]:
    """The screening copy of a float32 head in strips [1, V / 32, K, 32]: int8 codes in the same layout,
    one scale per column (f32[V]) and the bound's per-column factor `coeff` (f32[V]):
    coeff_v >= |q_v - w_v|_2 + 4 gamma_K (|q_v|_2 + |w_v|_2), q_v the column as the kernel dequantizes
    it (code * scale in float32), gamma_K = K u / (1 - K u) (an FMA chain's rounding over K terms).
    Made by screen_head.cc where it builds (one pass over the head on every core: ~0.3 s less start-up
    for SmolLM2 on a Zen 3 core), else by `screen_head_reference`."""
    return _screen_head_kernel(strips) if load(SCREEN_HEAD) else screen_head_reference(strips)


def _bound_factors(K: int) -> tuple[float, float]:
    """(gamma_K, the factor that rounds a float32 |a|_2 over K terms up past its own error)"""
    return K * _U / (1 - K * _U), 1 + 2 * K * _U


@jax.jit
def screen_head_reference(strips: jax.Array) -> dict[str, jax.Array]:
    """`screen_head` in jnp."""
    K = strips.shape[2]
    w = strips[0]  # [V / 32, K, 32]: column v is lane v % 32 of strip v // 32, its k along axis 1
    codes, scale = quantize_windows(w, jnp.int8, K, reduction_axis=1)  # scale [V / 32, 32]
    dequantized = dequantize(codes, scale, K, 1, jnp.float32)
    gamma, rounding = _bound_factors(K)

    def norm(a):  # |a|_2 per column, rounded up past float32's own error
        return jnp.sqrt(jnp.sum(a * a, axis=1)) * rounding

    coeff = (norm(dequantized - w) + 4 * gamma * (norm(dequantized) + norm(w))) * (1 + _SLACK)
    return {"q": codes[None], "scale": scale.reshape(-1), "coeff": coeff.reshape(-1)}


@jax.jit
def _screen_head_kernel(strips: jax.Array) -> dict[str, jax.Array]:
    V = strips.shape[1] * STRIP
    gamma, rounding = _bound_factors(strips.shape[2])
    out = (jax.ShapeDtypeStruct(strips.shape, jnp.int8), jax.ShapeDtypeStruct((V,), jnp.float32),
           jax.ShapeDtypeStruct((V,), jnp.float32))
    q, scale, coeff = jax.ffi.ffi_call(SCREEN_HEAD.target, out)(
        strips, gamma4=np.float32(4 * gamma), factor=np.float32(rounding * (1 + _SLACK)))
    return {"q": q, "scale": scale, "coeff": coeff}


def greedy_logits(x: jax.Array, strips: jax.Array, screen: dict[str, jax.Array]) -> jax.Array:
    """x f32[R, K] (R <= MAX_ROWS) and the float32 head in strips [1, V / 32, K, 32] with its `screen_head`
    copy → f32[R, V] whose row-wise argmax is exactly that of `ops.cpu.linear.linear(x, strips, 0)`."""
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"greedy_logits: at most {MAX_ROWS} rows, got {x.shape[0]}")
    out = jax.ShapeDtypeStruct((x.shape[0], strips.shape[1] * STRIP), jnp.float32)
    return jax.ffi.ffi_call(GREEDY_HEAD.target, out)(x, strips, screen["q"], screen["scale"], screen["coeff"])
