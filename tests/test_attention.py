"""Paged attention against a per-token numpy computation over each request's contiguous context."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tokenmill.ops.attention import AttentionMetadata, paged_attention, paged_attention_ref, write_kv


def numpy_attention(q, keys, values, positions, scale, window):
    """q [H, D] of a token at `positions`; keys/values [ctx, KVH, D] of its request."""
    heads, kv_heads = q.shape[0], keys.shape[1]
    out = np.zeros_like(q)
    lo = 0 if window is None else max(0, positions - window + 1)
    for h in range(heads):
        k = keys[lo : positions + 1, h // (heads // kv_heads)]
        v = values[lo : positions + 1, h // (heads // kv_heads)]
        s = k @ q[h] * scale
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v
    return out


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("decode_only", [False, True])
def test_ragged_batch_matches_reference(window, decode_only):
    rng = np.random.default_rng(0)
    layers, num_blocks, bs, kvh, heads, d = 2, 64, 4, 2, 4, 8
    # (context already cached, new tokens this step) per request: a prefill chunk on top of a
    # cached prefix, a fresh prefill, decodes
    plan = [(0, 1), (9, 1), (17, 1)] if decode_only else [(6, 7), (0, 11), (9, 1), (17, 1)]
    tables = np.zeros((len(plan), 8), np.int32)
    perm = rng.permutation(np.arange(1, num_blocks))  # blocks scattered over the pool
    for r in range(len(plan)):
        tables[r] = perm[r * 8 : (r + 1) * 8]
    full_k = [rng.standard_normal((c + n, kvh, d)).astype(np.float32) for c, n in plan]
    full_v = [rng.standard_normal((c + n, kvh, d)).astype(np.float32) for c, n in plan]
    k_cache = np.zeros((layers, num_blocks, bs, kvh, d), np.float32)
    v_cache = np.zeros_like(k_cache)
    layer = 1
    for r, (c, _) in enumerate(plan):  # the cached prefix
        for p in range(c):
            k_cache[layer, tables[r, p // bs], p % bs] = full_k[r][p]
            v_cache[layer, tables[r, p // bs], p % bs] = full_v[r][p]
    positions, slots, token_req, new_k, new_v = [], [], [], [], []
    for r, (c, n) in enumerate(plan):
        for p in range(c, c + n):
            positions.append(p)
            slots.append(tables[r, p // bs] * bs + p % bs)
            token_req.append(r)
            new_k.append(full_k[r][p])
            new_v.append(full_v[r][p])
    pad = 3  # padding tokens: out-of-range slot, must not write anything
    total = len(positions)
    positions += [0] * pad
    slots += [num_blocks * bs] * pad
    token_req += [0] * pad
    new_k = np.concatenate([np.stack(new_k), np.zeros((pad, kvh, d), np.float32)])
    new_v = np.concatenate([np.stack(new_v), np.zeros((pad, kvh, d), np.float32)])
    q = rng.standard_normal((total + pad, heads, d)).astype(np.float32)
    md = AttentionMetadata(jnp.array(positions, jnp.int32), jnp.array(slots, jnp.int32),
                           jnp.array(token_req, jnp.int32), jnp.asarray(tables))
    kc, vc = write_kv(jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.int32(layer), jnp.asarray(new_k),
                      jnp.asarray(new_v), md.slot_mapping)
    out = np.asarray(paged_attention(jnp.asarray(q), kc, vc, jnp.int32(layer), md, scale=0.3, sliding_window=window))
    for t in range(total):
        r = token_req[t]
        expected = numpy_attention(q[t], full_k[r], full_v[r], positions[t], 0.3, window)
        np.testing.assert_allclose(out[t], expected, rtol=1e-5, atol=1e-5)
    assert np.isfinite(out).all()
    # the padding writes were dropped: layer 0 untouched, nothing beyond the plan written
    assert not np.asarray(kc)[0].any()


def test_tiled_path_matches_untiled():
    """The reference processes more than 256 tokens in tiles; the result must not change."""
    rng = np.random.default_rng(1)
    num_blocks, bs, kvh, heads, d = 160, 4, 1, 2, 8
    T = 512
    k_cache = jnp.asarray(rng.standard_normal((1, num_blocks, bs, kvh, d)).astype(np.float32))
    v_cache = jnp.asarray(rng.standard_normal((1, num_blocks, bs, kvh, d)).astype(np.float32))
    tables = jnp.asarray(np.arange(num_blocks, dtype=np.int32).reshape(1, -1)[:, :128])
    md = AttentionMetadata(jnp.arange(T, dtype=jnp.int32), jnp.arange(T, dtype=jnp.int32),
                           jnp.zeros(T, jnp.int32), tables)
    q = jnp.asarray(rng.standard_normal((T, heads, d)).astype(np.float32))
    tiled = paged_attention_ref(q, k_cache, v_cache, jnp.int32(0), md, scale=0.5)
    half = AttentionMetadata(md.positions[:200], md.slot_mapping[:200], md.token_request[:200], tables)
    untiled = paged_attention_ref(q[:200], k_cache, v_cache, jnp.int32(0), half, scale=0.5)
    np.testing.assert_allclose(np.asarray(tiled[:200]), np.asarray(untiled), rtol=1e-5, atol=1e-6)
