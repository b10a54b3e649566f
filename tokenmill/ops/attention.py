"""Paged attention over a ragged batch that mixes prefill chunks and decode tokens.

The KV cache of a model is two arrays `[layers, num_blocks, block_size, kv_heads, head_dim]`.
A step's batch is flattened: T tokens, each with its position, its cache slot
(`block_id * block_size + offset`) and the index of the request it belongs to; each request has a
row of block ids (its block table). New K/V are written to the cache first, then every token
attends to its request's cached context up to its own position, so a prefill chunk sees the
context earlier steps left in the cache.

`paged_attention_ref` is the plain `jnp` reference (the oracle and the fallback): it gathers each
token's context from the cache. Faster paths must match it. `paged_attention` dispatches, at trace
time, per TOKENMILL_ATTENTION_BACKEND: `auto` takes the C++ kernel (tokenmill/ops/cpu, through
JAX's FFI) on CPU when it builds and suits the operands, else the reference; `reference` and
`cpu_kernel` force one path (`cpu_kernel` raises if the kernel cannot be built).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tokenmill import envs

# A bfloat16 cache on CPU is held as its bits in uint16 arrays: XLA:CPU scatters into a bfloat16 array
# by converting the whole of it (SmolLM2's cache of 8193 blocks, copied each layer: ~2 s a decode
# step), while a uint16 scatter writes in place. The kernel reads the bits as bfloat16.
BFLOAT16_BITS = jnp.dtype(jnp.uint16)

# Masked scores use a finite floor so that fully masked (padding) rows stay finite.
_MASK_VALUE = -1e30
# Tokens are processed in tiles of this many so the gathered context stays bounded in memory.
_TOKEN_TILE = 256


class AttentionMetadata(NamedTuple):
    positions: jax.Array  # i32[T]
    slot_mapping: jax.Array  # i32[T]; padding tokens hold an out-of-range slot (writes dropped)
    token_request: jax.Array  # i32[T]: row of the token's request in block_tables
    block_tables: jax.Array  # i32[R, max_blocks]
    # i32[]: the tokens before the padding (None: no padding); the linear kernel skips the rest
    num_tokens: jax.Array | None = None


class OutputRows(NamedTuple):
    """The rows of a step whose final hidden states are wanted: index[:count] (the rest of `index` is
    padding). A step that only samples wants one row per request, its last: `forward` then runs the
    last layer past its KV write for these rows alone (a prefill of 16 x 128 tokens skips 94% of
    that layer: 3% of the step)."""

    index: jax.Array  # i32[T]
    count: jax.Array  # i32[]


def select_rows(md: AttentionMetadata, rows: OutputRows) -> AttentionMetadata:
    """The metadata of the tokens rows.index[:count] (attention only: their K/V is written); the
    padding past count attends to one key, like a bucket's padding tokens."""
    real = jnp.arange(rows.index.shape[0]) < rows.count
    return md._replace(
        positions=jnp.where(real, md.positions[rows.index], 0),
        slot_mapping=md.slot_mapping[rows.index],
        token_request=jnp.where(real, md.token_request[rows.index], 0),
        num_tokens=rows.count,
    )


def cache_storage_dtype(dtype) -> jnp.dtype:
    """The array dtype that holds a KV cache of `dtype` on this backend (BFLOAT16_BITS for bfloat16 on CPU)."""
    dtype = jnp.dtype(dtype)
    return BFLOAT16_BITS if dtype == jnp.bfloat16 and jax.default_backend() == "cpu" else dtype


def cache_values(x: jax.Array) -> jax.Array:
    """Entries read from a cache, as their values (bfloat16 bits viewed as bfloat16)."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == BFLOAT16_BITS else x


def _to_cache(x: jax.Array, cache_dtype) -> jax.Array:
    if cache_dtype == BFLOAT16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), BFLOAT16_BITS)
    return x.astype(cache_dtype)


def write_kv(
    k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's K/V ([T, kv_heads, head_dim]) into layer `layer` of the caches."""
    block_size = k_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache = k_cache.at[layer, blocks, offsets].set(_to_cache(k, k_cache.dtype), mode="drop")
    v_cache = v_cache.at[layer, blocks, offsets].set(_to_cache(v, v_cache.dtype), mode="drop")
    return k_cache, v_cache


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: jax.Array | int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """q: [T, heads, head_dim] → [T, heads, head_dim]; see `paged_attention_ref` for the semantics."""
    backend = envs.TOKENMILL_ATTENTION_BACKEND
    if backend != "reference":
        from tokenmill.ops import cpu

        if backend == "cpu_kernel" or (
            jax.default_backend() == "cpu" and cpu.usable_for(q, k_cache) and cpu.available()
        ):
            return cpu.paged_attention(
                q, k_cache, v_cache, layer, md, scale=scale, sliding_window=sliding_window, sinks=sinks
            )
    return paged_attention_ref(
        q, k_cache, v_cache, layer, md, scale=scale, sliding_window=sliding_window, sinks=sinks
    )


def paged_attention_ref(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: jax.Array | int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """q: [T, heads, head_dim] → [T, heads, head_dim].

    Token t attends to the cached keys at positions p of its request with
    `p <= positions[t]` and, with a sliding window W, `p > positions[t] - W`. `sinks` ([heads],
    gpt-oss) are per-head logits that join every softmax denominator without a value: attention
    may then put weight on "nothing". A token that sees no key at all gets the plain mean of V over
    its block-table row, sinks or not (only padding tokens do; the kernel does the same).
    """
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[3]
    tile = _TOKEN_TILE if num_tokens > _TOKEN_TILE and num_tokens % _TOKEN_TILE == 0 else num_tokens

    def attend(args):
        q_t, pos_t, req_t = args
        tables = md.block_tables[req_t]  # [tile, max_blocks]
        k = cache_values(k_cache[layer, tables])  # [tile, max_blocks, block_size, kv_heads, head_dim]
        v = cache_values(v_cache[layer, tables])
        # [tile, kv_heads, context, head_dim]: batch dims leading, in the same order on both
        # operands, measured ~3x faster than an einsum with the context axis in between on XLA:CPU
        k = k.reshape(tile, -1, kv_heads, head_dim).transpose(0, 2, 1, 3)
        v = v.reshape(tile, -1, kv_heads, head_dim).transpose(0, 2, 1, 3)
        qg = q_t.reshape(tile, kv_heads, num_heads // kv_heads, head_dim)
        batch = ((0, 1), (0, 1))
        scores = jax.lax.dot_general(qg, k, (((3,), (3,)), batch), preferred_element_type=jnp.float32) * scale
        key_pos = jnp.arange(k.shape[2])[None, :]
        visible = key_pos <= pos_t[:, None]
        if sliding_window is not None:
            visible &= key_pos > pos_t[:, None] - sliding_window
        scores = jnp.where(visible[:, None, None, :], scores, _MASK_VALUE)
        if sinks is None:
            probs = jax.nn.softmax(scores, axis=-1)
        else:
            head_sinks = sinks.reshape(kv_heads, -1).astype(jnp.float32)
            sink = jnp.where(visible.any(-1)[:, None, None], head_sinks, -jnp.inf)  # [tile, kv_heads, group]
            top = jnp.maximum(scores.max(-1), sink)[..., None]
            e = jnp.exp(scores - top)
            probs = e / (e.sum(-1, keepdims=True) + jnp.exp(sink[..., None] - top))
        # probabilities in the wider of q's and the cache's types: a float32 model over a bfloat16
        # cache keeps them in float32, as the kernel does
        out = jax.lax.dot_general(
            probs.astype(jnp.promote_types(q.dtype, v.dtype)), v, (((3,), (2,)), batch),
            preferred_element_type=jnp.float32,
        )
        return out.reshape(tile, num_heads, head_dim).astype(q.dtype)

    if tile == num_tokens:
        return attend((q, md.positions, md.token_request))
    n = num_tokens // tile
    tiled = jax.lax.map(
        attend,
        (
            q.reshape(n, tile, num_heads, head_dim),
            md.positions.reshape(n, tile),
            md.token_request.reshape(n, tile),
        ),
    )
    return tiled.reshape(num_tokens, num_heads, head_dim)
