"""Fused mixture-of-experts FFN: routing, grouped expert matmuls, weighted combine.

`fused_moe(tokens [T, D], w1 [E, 2, D, F], w2 [E, F, D], gating_output [T, E], top_k, ...)` → [T, D].
w1[:, 0] is the gate projection, w1[:, 1] the up projection. Routing: softmax over the experts in
float32, the top-k of it, and optionally the k weights renormalised to sum to 1. Each token goes
through its k experts (b1 added to gate/up before the activation, b2 after the down projection) and
the expert outputs are summed, weighted by the routing weights.

`ref_moe` is the oracle: every expert applied to every token, the results masked by routing weight.
`fused_moe` computes only what the routing asks for, expert by expert:

- the T*k (token, expert) assignments are sorted by expert and each expert's group is cut into
  tiles: whole tiles of the largest size (256 rows), then one tile of the smallest size in
  `_TILE_SIZES` that holds the rest;
- one while loop per tile size runs over the tiles of that size that are used (experts that
  received no token have none): gather the tile's token rows, read its expert's weights by dynamic
  index (dequantizing them there, one expert at a time), gate/up matmuls, activation, down matmul,
  scatter-add of the weighted rows into the output.

On CPU, with float32 tokens and float32, int8 or float8 experts, the expert FFNs go to a C++ kernel
instead (ops/cpu/moe_experts.cc, TOKENMILL_MOE_BACKEND): it takes the same sorted assignments
(`expert_groups`) and reads each expert's weights in place, packed (and dequantized) a panel at a
time, with the next panel prefetched while the current one is multiplied. At the default `tokenmill bench moe` layer
(Qwen3-30B-A3B shapes, 512 tokens) it took 0.26 s where the jnp tiles below took 0.44 s, on a
2-core Xeon with AVX-512. The tiles remain the path for fp4 experts and other platforms, and the
kernel's test oracle.

Float32 experts may also be given in the kernel's strips (`kernel_layout`, made once at load time:
w1 [E, 2, F / 32, D, 32], w2 [E, D / 32, F, 32]), which it multiplies where they lie instead of
packing every panel of every expert on every call: the same layer then took 0.20 s instead of
0.26 s. Any other path reads them back as [E, 2, D, F] / [E, F, D] first.

Why tiles and not `jax.lax.ragged_dot`: in jax 0.10.2 the CPU lowering of ragged_dot
(`_ragged_dot_general_impl`; `jax_ragged_dot_use_ragged_dot_instruction` is TPU-only) densifies:
it masks the rows into an [E, T*k, D] operand and multiplies it by every expert. Measured on this
project's 2-core CPU (hidden 2048, intermediate 768, top-8): a whole MoE layer through ragged_dot
took 3.0 s for 128 tokens over 32 experts and 11.9 s for 512 tokens, the tiles 0.39 s and 0.63 s.

Why a tile per expert rather than fixed tiles of B rows: on XLA:CPU a [M, D] x [D, F] matmul of an
expert's [2048, 1536] weights costs a near-constant ~5.5 ms from M = 16 to 48 rows (the weights are copied out of
the stack and packed by the GEMM whatever M is), so every extra tile of an expert costs about as
much as the first. With fixed 32-row tiles the default `tokenmill bench moe` layer took 1.9 s; one
tile per expert 1.2 s. Below 16 rows XLA emits its own matrix-vector code, cheaper per row read,
hence the 1- and 8-row sizes for decode-sized groups.

Quantized expert weights (int8, fp8 e4m3 / e5m2, fp4 e2m1) carry one float32 scale per
window of `subc_quant_wsz` rows along the reduction axis (`ops.quantization.quantize_windows` makes them).

With a `mesh` (axes "data", "model") the experts are sharded over "model" (expert parallel): every
device takes all tokens and the routing, computes the assignments to its own experts, and the partial
outputs are summed over "model". TOKENMILL_USE_MOE_EP_KERNEL=0 computes `ref_moe` instead, under the
shardings the arrays carry.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tokenmill import envs
from tokenmill.distributed.mesh import is_unsharded
from tokenmill.ops.activations import get_activation
from tokenmill.ops.cpu import linear as cpu_linear
from tokenmill.ops.cpu import moe as cpu_moe
from tokenmill.ops.quantization import dequantize as _dequantize

# The row counts a tile is computed with (see the module docstring for why these).
_TILE_SIZES = (1, 8, 32, 64, 128, 256)

# The gated activations act(gate, up); "gelu" is the exact (erf) GELU as in ops/activations.py,
# "gelu_pytorch_tanh" its tanh approximation; "swigluoai" is gpt-oss's clamped SwiGLU.
ACT_FNS = ("silu", "gelu", "gelu_pytorch_tanh", "swigluoai")

# Expert weight dtypes that need scales: int8, the 8-bit floats and fp4 (e2m1; XLA:CPU in jaxlib
# 0.10.2 converts it, as tests/test_moe.py checks).
QUANT_DTYPES = (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn)


def route(gating_output: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """[T, E] logits → (weights f32[T, k], expert ids i32[T, k])."""
    probs = jax.nn.softmax(gating_output.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def _gated_activation(gate: jax.Array, up: jax.Array, act_fn: str, alpha: float, limit: float) -> jax.Array:
    if act_fn == "swigluoai":
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return gate * jax.nn.sigmoid(alpha * gate) * (up + 1)
    return get_activation(act_fn)(gate) * up


def _expert_ffn(x, w1_e, w2_e, b1_e, b2_e, act_fn: str, alpha: float, limit: float) -> jax.Array:
    """One expert on rows x [N, D]: w1_e [2, D, F], w2_e [F, D] → float32 [N, D]."""
    # gate and up as two plain [N, D] x [D, F] dots: one einsum over w1_e's leading axis measured
    # ~1.5x slower on XLA:CPU (it copies the [2, D, F] slice into a batched-dot layout)
    gate = jnp.dot(x, w1_e[0], preferred_element_type=jnp.float32)
    up = jnp.dot(x, w1_e[1], preferred_element_type=jnp.float32)
    if b1_e is not None:
        gate, up = gate + b1_e[0].astype(jnp.float32), up + b1_e[1].astype(jnp.float32)
    h = _gated_activation(gate, up, act_fn, alpha, limit)
    y = jnp.dot(h.astype(w2_e.dtype), w2_e, preferred_element_type=jnp.float32)
    if b2_e is not None:
        y = y + b2_e.astype(jnp.float32)
    return y


def _validate(tokens, w1, w2, gating_output, top_k, act_fn, b1, b2, w1_scale, w2_scale, wsz, mesh) -> None:
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [T, D], got shape {tokens.shape}")
    num_tokens, hidden = tokens.shape
    if w1.ndim != 4 or w1.shape[1] != 2 or w1.shape[2] != hidden:
        raise ValueError(f"w1 must be [E, 2, D={hidden}, F], got shape {w1.shape}")
    num_experts, _, _, inter = w1.shape
    if w2.shape != (num_experts, inter, hidden):
        raise ValueError(f"w2 must be [E, F, D] = {(num_experts, inter, hidden)}, got shape {w2.shape}")
    if gating_output.shape != (num_tokens, num_experts):
        raise ValueError(f"gating_output must be [T, E] = {(num_tokens, num_experts)}, got {gating_output.shape}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, E={num_experts}], got {top_k}")
    if act_fn not in ACT_FNS:
        raise ValueError(f"unsupported act_fn {act_fn!r}; supported: {', '.join(ACT_FNS)}")
    if b1 is not None and b1.shape != (num_experts, 2, inter):
        raise ValueError(f"b1 must be [E, 2, F] = {(num_experts, 2, inter)}, got shape {b1.shape}")
    if b2 is not None and b2.shape != (num_experts, hidden):
        raise ValueError(f"b2 must be [E, D] = {(num_experts, hidden)}, got shape {b2.shape}")
    if (w1_scale is None) != (w2_scale is None):
        missing = "w1_scale" if w1_scale is None else "w2_scale"
        raise ValueError(f"{missing} is missing: quantized experts need both w1_scale and w2_scale")
    if w1_scale is None:
        if wsz is not None:
            raise ValueError("subc_quant_wsz given without w1_scale and w2_scale")
        for name, w in (("w1", w1), ("w2", w2)):
            if w.dtype in QUANT_DTYPES:
                raise ValueError(f"{name} is {w.dtype}: quantized experts need w1_scale, w2_scale, subc_quant_wsz")
    else:
        if wsz is None:
            raise ValueError("w1_scale and w2_scale need subc_quant_wsz (the scale window size)")
        for dim_name, dim in (("D", hidden), ("F", inter)):
            if wsz <= 0 or dim % wsz:
                raise ValueError(f"subc_quant_wsz={wsz} must divide the reduction dim {dim_name}={dim}")
        for name, scale, expected in (
            ("w1_scale", w1_scale, (num_experts, 2, hidden // wsz, inter)),
            ("w2_scale", w2_scale, (num_experts, inter // wsz, hidden)),
        ):
            if scale.shape != expected:
                raise ValueError(f"{name} must have shape {expected}, got {scale.shape}")
    if mesh is not None:
        if "model" not in mesh.axis_names:
            raise ValueError(f"mesh needs a 'model' axis to shard the experts over; it has {mesh.axis_names}")
        model_size = mesh.shape["model"]
        if num_experts % model_size:
            raise ValueError(
                f"the number of experts ({num_experts}) is not divisible by "
                f"the mesh's model axis size ({model_size})"
            )


def ref_moe(
    tokens: jax.Array,
    w1: jax.Array,
    w2: jax.Array,
    gating_output: jax.Array,
    top_k: int,
    *,
    renormalize_topk_logits: bool,
    act_fn: str,
    b1: jax.Array | None = None,
    b2: jax.Array | None = None,
    w1_scale: jax.Array | None = None,
    w2_scale: jax.Array | None = None,
    subc_quant_wsz: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> jax.Array:
    """The oracle: every expert on every token, each output masked by the token's routing weight
    for that expert (0 when the expert is not among its top-k). `mesh` is accepted for a common
    signature; the computation follows the shardings its inputs carry."""
    _validate(tokens, w1, w2, gating_output, top_k, act_fn, b1, b2, w1_scale, w2_scale, subc_quant_wsz, mesh)
    num_tokens, num_experts = gating_output.shape
    weights, ids = route(gating_output, top_k, renormalize_topk_logits)
    # [T, E]: a token's routing weight for each expert
    combine = jnp.zeros((num_tokens, num_experts), jnp.float32)
    combine = combine.at[jnp.arange(num_tokens)[:, None], ids].add(weights)

    def one_expert(w1_e, w2_e, b1_e, b2_e, s1_e, s2_e):
        w1_e = _dequantize(w1_e, s1_e, subc_quant_wsz, 1, tokens.dtype)
        w2_e = _dequantize(w2_e, s2_e, subc_quant_wsz, 0, tokens.dtype)
        return _expert_ffn(tokens, w1_e, w2_e, b1_e, b2_e, act_fn, swiglu_alpha, swiglu_limit)

    per_expert = jax.vmap(one_expert)(w1, w2, b1, b2, w1_scale, w2_scale)  # [E, T, D]
    return jnp.einsum("te,etd->td", combine, per_expert).astype(tokens.dtype)


class TileLayout(NamedTuple):
    """The routed assignments sorted by expert and cut into tiles of one expert each; the tiles are
    ordered by the size they are computed with (an index into `tile_sizes`)."""

    sorted_token: jax.Array  # i32[A + max tile]: the assignments' tokens, by expert; T past the end
    sorted_weight: jax.Array  # f32[A + max tile]: their routing weights
    tile_expert: jax.Array  # i32[num_tiles]: each tile's local expert
    tile_start: jax.Array  # i32[num_tiles]: its first assignment in the sorted arrays
    tile_rows: jax.Array  # i32[num_tiles]: how many assignments it holds
    size_begin: jax.Array  # i32[len(tile_sizes)]: the first tile computed with each size
    size_count: jax.Array  # i32[len(tile_sizes)]: how many tiles are; tiles after the last are unused


def tile_sizes(num_assignments: int) -> tuple[int, ...]:
    """The tile sizes worth compiling for this many assignments (none much larger than all of them)."""
    sizes = tuple(s for s in _TILE_SIZES if s < num_assignments)
    return sizes + tuple(s for s in _TILE_SIZES if s >= num_assignments)[:1]


class ExpertGroups(NamedTuple):
    """The routed assignments to one device's experts, sorted by expert (stable: by token within one)."""

    sorted_token: jax.Array  # i32[A]: the assignments' tokens; T for assignments to other devices' experts
    sorted_weight: jax.Array  # f32[A]: their routing weights (0 for other devices')
    group_sizes: jax.Array  # i32[num_local_experts]: how many assignments each local expert has


def expert_groups(
    weights: jax.Array, ids: jax.Array, num_local_experts: int, expert_start: jax.Array | int
) -> ExpertGroups:
    """Sort the [T, k] assignments by expert, keeping those to experts [expert_start,
    expert_start + num_local_experts); the others sort last."""
    num_tokens, top_k = ids.shape
    # foreign assignments sort last, as group `num_local_experts`
    local = ids.reshape(-1) - expert_start
    local = jnp.where((local >= 0) & (local < num_local_experts), local, num_local_experts)
    order = jnp.argsort(local, stable=True)
    is_local = local[order] < num_local_experts
    return ExpertGroups(
        jnp.where(is_local, order // top_k, num_tokens).astype(jnp.int32),
        jnp.where(is_local, weights.reshape(-1)[order], 0.0).astype(jnp.float32),
        jnp.bincount(local, length=num_local_experts + 1)[:num_local_experts].astype(jnp.int32),
    )


def tile_layout(
    weights: jax.Array, ids: jax.Array, num_local_experts: int, expert_start: jax.Array | int
) -> TileLayout:
    """Group the assignments to experts [expert_start, expert_start + num_local_experts) by expert,
    each group cut into tiles of the largest tile size; the last tile of a group takes the smallest
    size that holds it. Assignments to other experts (other devices') are left out."""
    num_tokens, top_k = ids.shape
    num_assignments = num_tokens * top_k
    sizes = tile_sizes(num_assignments)
    max_size = sizes[-1]
    # each expert with a token adds at most one partial tile
    num_tiles = -(-num_assignments // max_size) + min(num_local_experts, num_assignments)

    groups = expert_groups(weights, ids, num_local_experts, expert_start)
    group_sizes = groups.group_sizes
    # padded by a tile so that slicing a whole tile from any start stays in bounds
    sorted_token = jnp.concatenate([groups.sorted_token, jnp.full(max_size, num_tokens, jnp.int32)])
    sorted_weight = jnp.concatenate([groups.sorted_weight, jnp.zeros(max_size, jnp.float32)])

    group_begin = jnp.cumsum(group_sizes) - group_sizes
    tiles_per_expert = -(-group_sizes // max_size)
    tile_end = jnp.cumsum(tiles_per_expert)
    tile = jnp.arange(num_tiles)
    expert = jnp.minimum(jnp.searchsorted(tile_end, tile, side="right"), num_local_experts - 1)
    done = (tile - (tile_end[expert] - tiles_per_expert[expert])) * max_size  # rows of the group's earlier tiles
    rows = jnp.clip(group_sizes[expert] - done, 0, max_size)
    # unused tiles take size index len(sizes): they sort last and fall in no size's range
    size = jnp.where(tile < tile_end[-1], jnp.searchsorted(jnp.asarray(sizes), rows, side="left"), len(sizes))
    by_size = jnp.argsort(size, stable=True)
    size_count = jnp.bincount(size, length=len(sizes) + 1)[: len(sizes)]
    return TileLayout(
        sorted_token,
        sorted_weight,
        expert[by_size],
        (group_begin[expert] + done)[by_size],
        rows[by_size],
        jnp.cumsum(size_count) - size_count,
        size_count,
    )


def _decode_float8(bits: jax.Array, dtype) -> jax.Array:
    """float8 (e4m3fn or e5m2) values given as their uint8 bits → float32, with integer ops only."""
    mantissa_bits, bias = (3, 7) if dtype == jnp.float8_e4m3fn else (2, 15)
    magnitude = bits.astype(jnp.uint32) & 0x7F
    exponent = magnitude >> mantissa_bits
    mantissa = magnitude & ((1 << mantissa_bits) - 1)
    # normal numbers: the exponent re-biased, both fields moved to where float32 keeps them
    normal = jax.lax.bitcast_convert_type(
        (magnitude + ((127 - bias) << mantissa_bits)) << (23 - mantissa_bits), jnp.float32
    )
    subnormal = mantissa.astype(jnp.float32) * 2.0 ** (1 - bias - mantissa_bits)
    value = jnp.where(exponent == 0, subnormal, normal)
    if dtype == jnp.float8_e4m3fn:  # no infinities; S.1111.111 is NaN
        value = jnp.where(magnitude == 0x7F, jnp.nan, value)
    else:  # IEEE-like: the top exponent holds the infinities and NaNs
        value = jnp.where(exponent == 31, jnp.where(mantissa == 0, jnp.inf, jnp.nan), value)
    return jnp.where(bits >= 0x80, -value, value)


def _expert_weights(w, scale, e, wsz, reduction_axis: int, dtype) -> jax.Array:
    """Expert e's weights (w[e]) in `dtype`, dequantized here so that only the experts in use are;
    `reduction_axis` counts in w[e]."""
    if w.dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        # XLA:CPU slices a float8 array and casts float8 to float32 several times slower than it
        # handles bytes (the default bench layer: 2.8 s in fp8, 1.1 s in int8): slice the bytes, decode
        # them with integer ops
        values = _decode_float8(jax.lax.bitcast_convert_type(w, jnp.uint8)[e], w.dtype)
    else:
        values = w[e]
    return _dequantize(values, None if scale is None else scale[e], wsz, reduction_axis, dtype)


def _use_cpu_kernel(tokens, w1, w2, w1_scale, *, in_shard_map: bool) -> bool:
    """Whether the expert FFNs go to the C++ kernel (TOKENMILL_MOE_BACKEND)."""
    backend = envs.TOKENMILL_MOE_BACKEND
    if backend == "jnp":
        return False
    usable = cpu_moe.usable_for(tokens, w1, w2, w1_scale)
    if backend == "cpu_kernel":
        if not usable:
            raise ValueError(
                "TOKENMILL_MOE_BACKEND=cpu_kernel computes float32 tokens with float32 experts, or int8 / float8 "
                f"experts with scales, only; got tokens {tokens.dtype}, w1 {w1.dtype}, w2 {w2.dtype}"
            )
        return True
    # one opaque call cannot be partitioned by XLA: outside shard_map it must see whole arrays
    single_device = in_shard_map or jax.device_count() == 1
    return jax.default_backend() == "cpu" and usable and single_device and cpu_moe.available()


def _grouped_moe(
    tokens, weights, ids, w1, w2, b1, b2, w1_scale, w2_scale, expert_start, *, wsz, act_fn, alpha, limit,
    device_axis: str | None = None,
) -> jax.Array:
    """The assignments to the experts of w1/w2 (global ids from `expert_start` on) → f32 [T, D].
    Inside shard_map, `device_axis` names the mesh axis whose devices hold different experts."""
    if _use_cpu_kernel(tokens, w1, w2, w1_scale, in_shard_map=device_axis is not None):
        groups = expert_groups(weights, ids, w1.shape[0], expert_start)
        group_begin = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(groups.group_sizes)])
        return cpu_moe.moe_experts(
            tokens, w1, w2, b1, b2, groups.sorted_token, groups.sorted_weight, group_begin,
            act_fn=act_fn, alpha=alpha, limit=limit, w1_scale=w1_scale, w2_scale=w2_scale, wsz=wsz,
        )
    layout = tile_layout(weights, ids, w1.shape[0], expert_start)

    def one_tile(size, i, out):
        e = layout.tile_expert[i]
        start = layout.tile_start[i]
        # rows past the tile's own belong to the next expert: sent to token T, dropped
        mine = jnp.arange(size) < layout.tile_rows[i]
        token = jnp.where(mine, jax.lax.dynamic_slice_in_dim(layout.sorted_token, start, size), tokens.shape[0])
        weight = jax.lax.dynamic_slice_in_dim(layout.sorted_weight, start, size)
        x = tokens.at[token].get(mode="fill", fill_value=0)
        w1_e = _expert_weights(w1, w1_scale, e, wsz, 1, tokens.dtype)
        w2_e = _expert_weights(w2, w2_scale, e, wsz, 0, tokens.dtype)
        b1_e = None if b1 is None else b1[e]
        b2_e = None if b2 is None else b2[e]
        y = _expert_ffn(x, w1_e, w2_e, b1_e, b2_e, act_fn, alpha, limit)
        return out.at[token].add(y * weight[:, None], mode="drop")

    # one loop per tile size, each over the tiles of that size only: a lax.switch on the size inside a
    # single loop measured ~40% slower (its branches take the expert's weights as copied operands)
    out = jnp.zeros(tokens.shape, jnp.float32)
    if device_axis is not None:  # each device's loop adds its own experts' rows: a value that varies
        out = jax.lax.pcast(out, (device_axis,), to="varying")
    for k, size in enumerate(tile_sizes(ids.size)):
        begin = layout.size_begin[k]
        out = jax.lax.fori_loop(begin, begin + layout.size_count[k], functools.partial(one_tile, size), out)
    return out


def strips_suit(w1: jax.Array, w2: jax.Array, mesh: jax.sharding.Mesh) -> bool:
    """Whether experts w1 [..., E, 2, D, F] and w2 [..., E, F, D] (leading axes: a model's layers)
    compute fastest in the CPU kernel's strips over `mesh`: float32 experts where the kernel will
    multiply them."""
    if envs.TOKENMILL_MOE_BACKEND == "jnp" or jax.default_backend() != "cpu" or not is_unsharded(mesh):
        return False
    float32 = all(jnp.dtype(w.dtype) == jnp.float32 for w in (w1, w2))
    if not float32 or w1.shape[-1] % cpu_linear.STRIP or w2.shape[-1] % cpu_linear.STRIP:
        return False
    return cpu_moe.available()


def kernel_layout(w1: jax.Array, w2: jax.Array, mesh: jax.sharding.Mesh) -> tuple[jax.Array, jax.Array]:
    """The experts in the layout `fused_moe` computes fastest with over `mesh`: the CPU kernel's
    strips where `strips_suit`, else as they are."""
    if not strips_suit(w1, w2, mesh):
        return w1, w2
    return jax.jit(cpu_linear.to_strips)(w1), jax.jit(cpu_linear.to_strips)(w2)


def fused_moe(
    tokens: jax.Array,
    w1: jax.Array,
    w2: jax.Array,
    gating_output: jax.Array,
    top_k: int,
    *,
    renormalize_topk_logits: bool,
    act_fn: str,
    b1: jax.Array | None = None,
    b2: jax.Array | None = None,
    w1_scale: jax.Array | None = None,
    w2_scale: jax.Array | None = None,
    subc_quant_wsz: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> jax.Array:
    """tokens [T, D] → [T, D] in tokens' dtype; see the module docstring for the semantics."""
    in_strips = w1.ndim == 5  # the CPU kernel's layout (kernel_layout): read in place by that kernel only
    row_major = (jax.eval_shape(lambda a, b: (cpu_linear.from_strips(a), cpu_linear.from_strips(b)), w1, w2)
                 if in_strips else (w1, w2))
    _validate(tokens, *row_major, gating_output, top_k, act_fn, b1, b2, w1_scale, w2_scale, subc_quant_wsz, mesh)
    if in_strips and (mesh is not None or not _use_cpu_kernel(tokens, w1, w2, w1_scale, in_shard_map=False)):
        w1, w2 = cpu_linear.from_strips(w1), cpu_linear.from_strips(w2)
    weights, ids = route(gating_output, top_k, renormalize_topk_logits)
    compute = dict(wsz=subc_quant_wsz, act_fn=act_fn, alpha=swiglu_alpha, limit=swiglu_limit)
    if mesh is None:
        out = _grouped_moe(tokens, weights, ids, w1, w2, b1, b2, w1_scale, w2_scale, 0, **compute)
        return out.astype(tokens.dtype)
    if not envs.TOKENMILL_USE_MOE_EP_KERNEL:
        return ref_moe(
            tokens, w1, w2, gating_output, top_k, renormalize_topk_logits=renormalize_topk_logits, act_fn=act_fn,
            b1=b1, b2=b2, w1_scale=w1_scale, w2_scale=w2_scale, subc_quant_wsz=subc_quant_wsz,
            swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
        )

    num_local_experts = w1.shape[0] // mesh.shape["model"]

    def local_experts(tokens, weights, ids, w1, w2, b1, b2, w1_scale, w2_scale):
        start = jax.lax.axis_index("model") * num_local_experts
        mine = _grouped_moe(
            tokens, weights, ids, w1, w2, b1, b2, w1_scale, w2_scale, start, **compute, device_axis="model"
        )
        return jax.lax.psum(mine, "model")

    experts = P("model")
    out = jax.shard_map(
        local_experts,
        mesh=mesh,
        in_specs=(P(), P(), P(), experts, experts, experts, experts, experts, experts),
        out_specs=P(),
    )(tokens, weights, ids, w1, w2, b1, b2, w1_scale, w2_scale)
    return out.astype(tokens.dtype)
