"""The C++ CPU paged-attention kernel (tokenmill/ops/cpu) against the jnp reference.

The kernel must build on the test machine: if it cannot, these tests fail (they never skip).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenmill.ops import cpu
from tokenmill.ops.attention import AttentionMetadata, paged_attention, paged_attention_ref, write_kv
from tokenmill.ops.cpu import build

TOL = dict(rtol=1e-5, atol=1e-5)


def require_kernel() -> None:
    assert cpu.available(), f"the CPU paged-attention kernel did not build: {cpu.build_error()}"


def test_kernel_builds_and_registers():
    require_kernel()
    assert build.library_path(
        build.PAGED_ATTENTION, build.find_compiler(), build._BASE_FLAGS + build.isa_flags()
    ).is_file()


def make_batch(
    rng, plan, *, kv_heads, group, head_dim, block_size=4, layers=2, layer=1, num_blocks=None, pad=3,
    dtype=np.float32, extra_blocks=0,
):
    """A ragged batch: plan = [(cached, new)] per request. Returns q, caches (after the write), md."""
    heads = kv_heads * group
    max_blocks = max(-(-(c + n) // block_size) for c, n in plan) + extra_blocks
    num_blocks = num_blocks or len(plan) * max_blocks + 5
    tables = rng.permutation(np.arange(num_blocks))[: len(plan) * max_blocks].reshape(len(plan), max_blocks)
    tables = tables.astype(np.int32)  # scattered over the pool
    k_cache = rng.standard_normal((layers, num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
    v_cache = rng.standard_normal((layers, num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
    positions, slots, token_req = [], [], []
    for r, (c, n) in enumerate(plan):  # prefixes [0, c) are already cached (random data above)
        for p in range(c, c + n):
            positions.append(p)
            slots.append(tables[r, p // block_size] * block_size + p % block_size)
            token_req.append(r)
    positions += [0] * pad  # padding tokens: out-of-range slot
    slots += [num_blocks * block_size] * pad
    token_req += [0] * pad
    T = len(positions)
    new_k = rng.standard_normal((T, kv_heads, head_dim)).astype(np.float32)
    new_v = rng.standard_normal((T, kv_heads, head_dim)).astype(np.float32)
    q = rng.standard_normal((T, heads, head_dim)).astype(np.float32)
    md = AttentionMetadata(
        jnp.array(positions, jnp.int32), jnp.array(slots, jnp.int32), jnp.array(token_req, jnp.int32),
        jnp.asarray(tables),
    )
    kc, vc = write_kv(
        jnp.asarray(k_cache, dtype), jnp.asarray(v_cache, dtype), jnp.int32(layer), jnp.asarray(new_k, dtype),
        jnp.asarray(new_v, dtype), md.slot_mapping,
    )
    return jnp.asarray(q, dtype), kc, vc, md


def both(q, kc, vc, layer, md, scale, window, sinks=None):
    """(kernel, reference) under jit, the window traced when it is an array."""

    def run(fn):
        f = jax.jit(
            lambda q, kc, vc, layer, md, w, s: fn(q, kc, vc, layer, md, scale=scale, sliding_window=w, sinks=s)
        )
        return np.asarray(f(q, kc, vc, jnp.int32(layer), md, window, sinks).astype(jnp.float32))

    return run(cpu.paged_attention), run(paged_attention_ref)


MIXED_PLAN = [(6, 7), (0, 11), (9, 1), (17, 1), (30, 3), (0, 1)]  # cached-prefix chunk, prefill, decodes


# 40: not a multiple of 16 (8-wide vectors where the build has AVX-512); 20: not one of 8 (scalar tails)
@pytest.mark.parametrize("head_dim", [20, 40, 64, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window", [None, 5])
def test_kernel_matches_reference(group, head_dim, window):
    require_kernel()
    rng = np.random.default_rng(group * 1000 + head_dim + (window or 0))
    q, kc, vc, md = make_batch(rng, MIXED_PLAN, kv_heads=2, group=group, head_dim=head_dim)
    out, ref = both(q, kc, vc, 1, md, head_dim**-0.5, window)
    np.testing.assert_allclose(out, ref, **TOL)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("group", [1, 3, 8])
def test_attention_sinks_match_reference_and_softmax_with_an_extra_column(group):
    """gpt-oss sinks: a per-head logit in the softmax denominator. The reference is checked against
    a dense numpy softmax over [scores, sink]; the kernel against the reference, windows included."""
    require_kernel()
    rng = np.random.default_rng(40 + group)
    plan = [(6, 7), (0, 11), (70, 1)]
    q, kc, vc, md = make_batch(rng, plan, kv_heads=2, group=group, head_dim=64, pad=2)
    sinks = jnp.asarray(rng.standard_normal(2 * group) * 3, jnp.float32)
    for window in (None, 5, jnp.int32(64)):
        out, ref = both(q, kc, vc, 1, md, 0.125, window, sinks)
        np.testing.assert_allclose(out, ref, **TOL)
    out, ref = both(q, kc, vc, 1, md, 0.125, None, sinks)
    qn, kn, vn = np.asarray(q), np.asarray(kc[1]), np.asarray(vc[1])
    tables, bs = np.asarray(md.block_tables), kn.shape[1]
    for t, (pos, r) in enumerate(zip(np.asarray(md.positions)[:-2], np.asarray(md.token_request))):
        slots = [(tables[r, p // bs], p % bs) for p in range(pos + 1)]
        k = np.stack([kn[b, o] for b, o in slots])  # [ctx, kv_heads, D]
        v = np.stack([vn[b, o] for b, o in slots])
        for h in range(2 * group):
            scores = k[:, h // group] @ qn[t, h] * 0.125
            e = np.exp(np.append(scores, sinks[h]) - max(scores.max(), float(sinks[h])))
            np.testing.assert_allclose(ref[t, h], (e[:-1] / e.sum()) @ v[:, h // group], rtol=1e-4, atol=1e-5)
    plain, _ = both(q, kc, vc, 1, md, 0.125, None)
    assert not np.allclose(out[:-2], plain[:-2], atol=1e-3)  # the sinks changed something


@pytest.mark.parametrize("num_tokens", [1, 2, 5])
def test_few_tokens(num_tokens):
    """Few tokens: work items are single kv heads rather than whole tokens."""
    require_kernel()
    rng = np.random.default_rng(num_tokens)
    plan = [(100 + 7 * i, 1) for i in range(num_tokens)]
    q, kc, vc, md = make_batch(rng, plan, kv_heads=4, group=2, head_dim=64, block_size=16, pad=0)
    for window in (None, 33):
        out, ref = both(q, kc, vc, 1, md, 0.125, window)
        np.testing.assert_allclose(out, ref, **TOL)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [3, 7])
def test_kernel_long_context_and_block_sizes(block_size, group):
    """Contexts spanning several online-softmax chunks (64 keys), GQA groups above 4, a head_dim
    that is not a multiple of 8, and table rows wider than the context."""
    require_kernel()
    rng = np.random.default_rng(block_size + group)
    plan = [(150, 1), (0, 70), (40, 90), (200, 2)]
    q, kc, vc, md = make_batch(
        rng, plan, kv_heads=1, group=group, head_dim=36, block_size=block_size, extra_blocks=2, pad=5
    )
    for window in (None, 100, jnp.int32(64)):
        out, ref = both(q, kc, vc, 1, md, 0.2, window)
        np.testing.assert_allclose(out, ref, **TOL)


@pytest.mark.parametrize("group,head_dim", [(3, 64), (8, 128), (1, 40), (2, 20)])
@pytest.mark.parametrize("window", [None, 60, 7])
def test_prefill_tiles_match_reference(group, head_dim, window):
    """A prefill's consecutive tokens, in tiles of up to 16 (rows padded for P . V): prompts spanning
    several chunks of keys per tile, with and without a cached prefix, tiles cut short by the next request
    or by a token alone, beside decode tokens and padding; windows (the tokens they cut take the one-token
    path), per-head sinks, head sizes that are not a multiple of the vectors."""
    require_kernel()
    rng = np.random.default_rng(group * 100 + head_dim + (window or 0))
    plan = [(0, 150), (70, 41), (5, 2), (200, 1), (0, 17), (33, 1)]
    q, kc, vc, md = make_batch(rng, plan, kv_heads=2, group=group, head_dim=head_dim, block_size=16, pad=3)
    out, ref = both(q, kc, vc, 1, md, head_dim**-0.5, window)
    np.testing.assert_allclose(out, ref, **TOL)
    sinks = jnp.asarray(rng.standard_normal(2 * group) * 3, jnp.float32)
    out, ref = both(q, kc, vc, 1, md, head_dim**-0.5, window, sinks)
    np.testing.assert_allclose(out, ref, **TOL)


@pytest.mark.parametrize("group,head_dim,window,dtype",
                         [(3, 64, None, np.float32), (8, 128, None, np.float32), (1, 40, None, np.float32),
                          (2, 20, None, np.float32), (3, 64, 50, np.float32), (7, 64, None, np.float32),
                          (3, 64, None, jnp.bfloat16)])
def test_a_token_gets_the_same_bits_in_a_tile_or_alone(group, head_dim, window, dtype):
    """A prefill's tokens, scored in tiles, each get bit for bit what the token gets alone (the one-token
    path, as when a prompt's last token is all of its chunk or a request decodes alone): scheduling and
    batching never change a result. With a window, tokens it cuts stay on the one-token path. Head sizes
    64 and 128 take the tiles' 16-lane scores, 40 the 8-lane ones, 20 the one-token scores; GQA 7 pads
    tiles of 112 and 28 rows past P . V's 114 and 30 to 128 and 32 lanes; bfloat16 caches convert on the way
    in (under float32 queries, so that the output keeps every bit)."""
    require_kernel()
    rng = np.random.default_rng(group + head_dim)
    q, kc, vc, md = make_batch(rng, [(0, 150), (37, 20), (3, 1)], kv_heads=2, group=group, head_dim=head_dim,
                               block_size=16, pad=0, dtype=dtype)
    q = q.astype(jnp.float32)
    run = jax.jit(lambda q, md: cpu.paged_attention(q, kc, vc, jnp.int32(1), md, scale=0.1, sliding_window=window))
    together = np.asarray(run(q, md))
    for t in (0, 1, 15, 16, 63, 64, 70, 149, 150, 160, 169, 170):
        alone = AttentionMetadata(md.positions[t:t + 1], md.slot_mapping[t:t + 1], md.token_request[t:t + 1],
                                  md.block_tables)
        np.testing.assert_array_equal(np.asarray(run(q[t:t + 1], alone))[0], together[t], err_msg=f"token {t}")


@pytest.mark.parametrize("head_dim,window,dtype", [(64, None, np.float32), (64, 100, np.float32),
                                                   (40, None, np.float32), (20, None, np.float32),
                                                   (64, None, jnp.bfloat16)])
def test_a_decode_token_gets_the_same_bits_alone_as_in_a_batch(head_dim, window, dtype):
    """A decode token alone (or with one other) has each kv head's chunks of 64 keys spread over the
    threads as separate items, their results folded after; in a batch of 16 one item runs all its chunks:
    the same bits, with sinks too, for contexts of one to several chunks, windows, and bfloat16 caches."""
    require_kernel()
    rng = np.random.default_rng(head_dim + (window or 0))
    contexts = [0, 1, 62, 63, 64, 65, 127, 128, 150, 200, 255, 256, 300, 17, 5, 90]
    q, kc, vc, md = make_batch(rng, [(c, 1) for c in contexts], kv_heads=3, group=3, head_dim=head_dim,
                               block_size=16, pad=0, dtype=dtype)
    q = q.astype(jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(9) * 3, jnp.float32)
    for s in (None, sinks):
        run = jax.jit(lambda q, md, s=s: cpu.paged_attention(q, kc, vc, jnp.int32(1), md, scale=0.1,
                                                             sliding_window=window, sinks=s))
        together = np.asarray(run(q, md))
        for t in range(len(contexts)):
            for ts in (np.array([t]), np.array([t, (t + 5) % len(contexts)])):  # alone, and beside another
                sub = AttentionMetadata(md.positions[ts], md.slot_mapping[ts], jnp.arange(len(ts), dtype=jnp.int32),
                                        md.block_tables[np.asarray(md.token_request)[ts]])
                np.testing.assert_array_equal(np.asarray(run(q[ts], sub))[0], together[t], err_msg=f"token {t}")
        ref = np.asarray(jax.jit(lambda q, md, s=s: paged_attention_ref(q, kc, vc, jnp.int32(1), md, scale=0.1,
                                                                         sliding_window=window, sinks=s))(q, md))
        np.testing.assert_allclose(together, ref, **TOL)


def test_traced_window_per_layer_like_gemma3():
    """The window is a traced scalar (Gemma 3 scans over a per-layer window array)."""
    require_kernel()
    rng = np.random.default_rng(7)
    q, kc, vc, md = make_batch(rng, MIXED_PLAN, kv_heads=1, group=4, head_dim=256)
    for w in (np.iinfo(np.int32).max // 2, 3, 1):
        out, ref = both(q, kc, vc, 1, md, 0.0625, jnp.int32(w))
        np.testing.assert_allclose(out, ref, **TOL)


def test_degenerate_tokens_match_reference():
    """Padding-like tokens with odd metadata: negative and huge positions, windows that hide
    everything, out-of-range request rows and block ids. The kernel reads nothing out of bounds
    and gives what the reference gives (jnp index clamping, all-masked softmax = mean)."""
    require_kernel()
    rng = np.random.default_rng(3)
    q, kc, vc, md = make_batch(rng, [(5, 2), (0, 3)], kv_heads=2, group=2, head_dim=64, pad=0)
    num_blocks = kc.shape[1]
    md = md._replace(
        positions=jnp.array([-3, 10_000, 2, 0, 4], jnp.int32),
        token_request=jnp.array([0, 1, 7, -1, -5], jnp.int32),
        block_tables=md.block_tables.at[1, 0].set(num_blocks + 3).at[0, 1].set(-2),
    )
    for window in (None, 2, jnp.int32(0), jnp.int32(-4)):
        for sinks in (None, jnp.linspace(-2.0, 2.0, 4)):
            out, ref = both(q, kc, vc, 1, md, 0.125, window, sinks)
            np.testing.assert_allclose(out, ref, **TOL)
            assert np.isfinite(out).all()


def test_padding_tokens_are_finite_and_write_nothing():
    require_kernel()
    rng = np.random.default_rng(11)
    q, kc, vc, md = make_batch(rng, [(0, 1)], kv_heads=3, group=3, head_dim=64, pad=20, layer=0)
    out, _ = both(q, kc, vc, 0, md, 0.125, None)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16])
def test_bfloat16(dtype):
    require_kernel()
    rng = np.random.default_rng(5)
    q, kc, vc, md = make_batch(rng, MIXED_PLAN, kv_heads=2, group=3, head_dim=64, dtype=dtype)
    out, ref = both(q, kc, vc, 1, md, 0.125, None)
    # the reference rounds the probabilities to bf16 before P·V; the kernel keeps them in fp32
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)
    # float32 queries over a bf16 cache (a float32 model with --kv-cache-dtype bfloat16): the reference
    # keeps the probabilities in float32 too, so only the order of the sums differs
    q32 = q.astype(jnp.float32)
    out32, ref32 = both(q32, kc, vc, 1, md, 0.125, None)
    np.testing.assert_allclose(out32, ref32, **TOL)
    np.testing.assert_allclose(out32, ref, rtol=2e-2, atol=2e-2)
    # the same cache held as its bits (how the model runner keeps a bfloat16 cache on CPU): the same results
    bits = [jax.lax.bitcast_convert_type(c, jnp.uint16) for c in (kc, vc)]
    out_bits, ref_bits = both(q32, *bits, 1, md, 0.125, None)
    np.testing.assert_array_equal(out_bits, out32)
    np.testing.assert_array_equal(ref_bits, ref32)


def test_inside_scan_with_traced_layer():
    """The layer loop of a model: write this layer's K/V, then attend, inside lax.scan with the
    layer index a traced carry; the kernel must see each layer's freshly written cache."""
    require_kernel()
    rng = np.random.default_rng(9)
    layers, kvh, group, d = 4, 3, 3, 64
    q, kc, vc, md = make_batch(rng, MIXED_PLAN, kv_heads=kvh, group=group, head_dim=d, layers=layers, layer=0)
    T = q.shape[0]
    new_k = jnp.asarray(rng.standard_normal((layers, T, kvh, d)).astype(np.float32))
    new_v = jnp.asarray(rng.standard_normal((layers, T, kvh, d)).astype(np.float32))
    w_mix = jnp.asarray(rng.standard_normal((layers, kvh * group * d, kvh * group * d)).astype(np.float32) * 0.05)

    def model(attn, q, kc, vc, md):
        def body(carry, xs):
            x, kc, vc, layer = carry
            k, v, w = xs
            kc, vc = write_kv(kc, vc, layer, k, v, md.slot_mapping)
            o = attn(x, kc, vc, layer, md, scale=0.125, sliding_window=None)
            x = x + (o.reshape(T, -1) @ w).reshape(x.shape)
            return (x, kc, vc, layer + 1), o

        (x, kc, vc, _), per_layer = jax.lax.scan(body, (q, kc, vc, jnp.int32(0)), (new_k, new_v, w_mix))
        return x, per_layer, kc, vc

    got = jax.jit(lambda *a: model(cpu.paged_attention, *a))(q, kc, vc, md)
    want = jax.jit(lambda *a: model(paged_attention_ref, *a))(q, kc, vc, md)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)


def test_donated_cache_in_place():
    """With the caches donated (as the runner does), the updated caches and outputs still match."""
    require_kernel()
    rng = np.random.default_rng(13)
    q, kc, vc, md = make_batch(rng, MIXED_PLAN, kv_heads=2, group=2, head_dim=64)
    new = jnp.asarray(rng.standard_normal((q.shape[0], 2, 64)).astype(np.float32))

    def step(attn, q, kc, vc, md):
        kc, vc = write_kv(kc, vc, jnp.int32(1), new, -new, md.slot_mapping)
        return attn(q, kc, vc, jnp.int32(1), md, scale=0.125), kc, vc

    want = jax.jit(lambda *a: step(paged_attention_ref, *a))(q, kc, vc, md)
    got = jax.jit(lambda *a: step(cpu.paged_attention, *a), donate_argnums=(1, 2))(q, kc, vc, md)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)


def _uses_kernel(monkeypatch, backend: str | None) -> bool:
    if backend is None:
        monkeypatch.delenv("TOKENMILL_ATTENTION_BACKEND", raising=False)
    else:
        monkeypatch.setenv("TOKENMILL_ATTENTION_BACKEND", backend)
    rng = np.random.default_rng(0)
    q, kc, vc, md = make_batch(rng, [(3, 2)], kv_heads=1, group=2, head_dim=8)
    jaxpr = jax.make_jaxpr(lambda q, kc, vc, md: paged_attention(q, kc, vc, jnp.int32(1), md, scale=1.0))(
        q, kc, vc, md
    )
    return "ffi_call" in str(jaxpr)


def test_env_var_selects_the_path(monkeypatch):
    require_kernel()
    assert _uses_kernel(monkeypatch, None)  # auto on a one-device CPU process
    assert _uses_kernel(monkeypatch, "auto")
    assert _uses_kernel(monkeypatch, "cpu_kernel")
    assert _uses_kernel(monkeypatch, "CPU_KERNEL")
    assert not _uses_kernel(monkeypatch, "reference")
    with pytest.raises(ValueError, match="TOKENMILL_ATTENTION_BACKEND"):
        _uses_kernel(monkeypatch, "triton")


def test_auto_falls_back_and_cpu_kernel_raises_when_unavailable(monkeypatch):
    monkeypatch.setattr(cpu, "available", lambda: False)
    assert not _uses_kernel(monkeypatch, "auto")
    with pytest.raises(RuntimeError, match="unavailable"):
        _uses_kernel(monkeypatch, "cpu_kernel")


def test_failed_build_warns_once_and_never_raises(monkeypatch, caplog):
    kernel = build.Kernel("tokenmill_test_no_compiler", "TokenmillPagedAttention", "paged_attention.cc")
    monkeypatch.setattr(build, "find_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.load(kernel) is False
        assert build.load(kernel) is False
    assert len([r for r in caplog.records if "tokenmill_test_no_compiler" in r.getMessage()]) == 1
    assert "no C++ compiler" in build.build_error(kernel)


def test_fresh_build_is_locked_and_atomic(monkeypatch, tmp_path):
    """Two concurrent first uses with an empty cache build once and both get a loadable library."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert build.cache_dir() == tmp_path / ".cache" / "tokenmill" / "kernels"
    paths, errors = [], []

    def go():
        try:
            paths.append(build.build(build.PAGED_ATTENTION))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(paths)) == 1 and paths[0].is_file()
    leftovers = [p.name for p in paths[0].parent.iterdir() if p.suffix == ".so" and p != paths[0]]
    assert not leftovers  # no temporary files left behind
    import ctypes

    assert hasattr(ctypes.CDLL(str(paths[0])), build.PAGED_ATTENTION.symbol)


@pytest.mark.parametrize("isa", ["portable", "avx2"])
def test_narrower_builds_match_reference(monkeypatch, isa):
    """The build without -mavx2/-mfma (what a CPU without AVX2 gets), and the AVX2 one without AVX-512
    (8-wide vectors, fewer registers: the development machines' AMD EPYC), compile and are exact too."""
    require_kernel()
    monkeypatch.setattr(build, "isa_flags", lambda: () if isa == "portable" else ("-mavx2", "-mfma"))
    kernel = build.Kernel(f"tokenmill_paged_attention_{isa}", build.PAGED_ATTENTION.symbol, "paged_attention.cc")
    assert build.load(kernel), build.build_error(kernel)
    monkeypatch.setattr(cpu, "PAGED_ATTENTION", kernel)  # route cpu.paged_attention to this target
    for head_dim in (64, 72):
        rng = np.random.default_rng(21 + head_dim)
        q, kc, vc, md = make_batch(rng, MIXED_PLAN, kv_heads=2, group=3, head_dim=head_dim, block_size=4)
        out, ref = both(q, kc, vc, 1, md, 0.125, 9)
        np.testing.assert_allclose(out, ref, **TOL)


_SHARDED = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from tokenmill.ops import cpu
    from tokenmill.ops.attention import AttentionMetadata, paged_attention, paged_attention_ref

    assert jax.device_count() == 2
    rng = np.random.default_rng(0)
    L, N, B, KVH, G, D, T = 2, 12, 4, 2, 3, 64, 6
    mesh = Mesh(np.array(jax.devices()).reshape(1, 2), ("data", "model"))
    cache_sh = NamedSharding(mesh, P(None, None, None, "model", None))
    kc = jax.device_put(rng.standard_normal((L, N, B, KVH, D)).astype(np.float32), cache_sh)
    vc = jax.device_put(rng.standard_normal((L, N, B, KVH, D)).astype(np.float32), cache_sh)
    q = jax.device_put(rng.standard_normal((T, KVH * G, D)).astype(np.float32), NamedSharding(mesh, P(None, "model")))
    md = AttentionMetadata(jnp.array([3, 7, 1, 0, 9, 2], jnp.int32), jnp.zeros(T, jnp.int32),
                           jnp.array([0, 1, 2, 0, 1, 2], jnp.int32), jnp.arange(12, dtype=jnp.int32).reshape(3, 4))
    f = lambda fn: jax.jit(lambda q, kc, vc, md: fn(q, kc, vc, jnp.int32(1), md, scale=0.125, sliding_window=4))
    # no mesh in context: `auto` cannot know the sharding and takes the reference
    assert "custom_call" not in f(paged_attention).lower(q, kc, vc, md).as_text()
    with jax.set_mesh(mesh):
        lowered = f(paged_attention).lower(q, kc, vc, md)
        assert "tokenmill_paged_attention" in lowered.as_text()
        hlo = lowered.compile().as_text()
        assert "all-gather" not in hlo, "the cache was gathered for the kernel"
        got = f(paged_attention)(q, kc, vc, md)
    want = f(paged_attention_ref)(q, kc, vc, md)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    print("OK")
    """
)


def test_tensor_parallel_shards_by_kv_head():
    """With a mesh set, the kernel runs per shard of kv heads (shard_map), without gathering the cache."""
    require_kernel()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    env.pop("TOKENMILL_ATTENTION_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", _SHARDED], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
