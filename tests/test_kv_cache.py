"""KVCacheManager: block pool, ref counts, hash-chained prefix cache, LRU eviction."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.core.kv_cache import NULL_BLOCK, KVCacheManager, hash_block_tokens
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams

BS = 4


def req(rid, tokens, lora_id=None, **sp):
    return Request(rid, list(tokens), SamplingParams(max_tokens=16, **sp), (), 0.0, 0, lora_id=lora_id)


def admit(kv, r):
    """What the scheduler does for a waiting request: look up hits, allocate the rest."""
    blocks, n = kv.get_computed_blocks(r)
    new = kv.allocate_slots(r, r.num_tokens - n, blocks)
    if new is not None:
        r.num_computed_tokens = r.num_tokens
    return blocks, n, new


def test_hash_is_chained_and_deterministic():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(a, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4], "lora-a") != a


def test_allocate_and_free_refcounts():
    kv = KVCacheManager(10, BS)
    assert kv.num_free_blocks == 9 and kv.usage == 0.0  # block 0 is the null block
    r = req("a", range(10))
    new = kv.allocate_slots(r, 10)
    assert len(new) == 3 and NULL_BLOCK not in new
    assert kv.get_block_ids("a") == new
    assert kv.num_free_blocks == 6
    r.num_computed_tokens = 10
    # 2 more tokens fit in the third block, a 3rd needs a 4th block
    assert kv.allocate_slots(r, 2) == []
    assert len(kv.allocate_slots(r, 3)) == 1
    kv.check_consistency()
    kv.free(r)
    kv.free(r)  # idempotent
    assert kv.num_free_blocks == 9
    kv.check_consistency()


def test_allocate_fails_without_side_effects():
    kv = KVCacheManager(5, BS)
    a = req("a", range(12))
    assert len(admit(kv, a)[2]) == 3
    b = req("b", range(100, 112))
    before = (list(kv.ref_cnt), list(kv.free_queue), dict(kv.cached), kv.prefix_cache_queries)
    assert kv.allocate_slots(b, 12) is None
    assert (list(kv.ref_cnt), list(kv.free_queue), dict(kv.cached), kv.prefix_cache_queries) == before
    assert "b" not in kv.req_blocks
    kv.check_consistency()


def test_prefix_hit_leaves_last_token():
    kv = KVCacheManager(20, BS)
    a = req("a", range(9))  # 2 full blocks + 1 token
    admit(kv, a)
    b = req("b", range(9))
    blocks, n, new = admit(kv, b)
    assert n == 8 and blocks == kv.get_block_ids("a")[:2]
    assert len(new) == 1
    assert [kv.ref_cnt[x] for x in blocks] == [2, 2]
    # a prompt that is exactly 2 full blocks hits only one: the last token is recomputed
    c = req("c", range(8))
    blocks, n, _ = admit(kv, c)
    assert n == 4 and len(blocks) == 1
    assert kv.prefix_cache_queries == 9 + 9 + 8
    assert kv.prefix_cache_hits == 8 + 4
    kv.check_consistency()


def test_hit_needs_same_prefix_and_lora():
    kv = KVCacheManager(20, BS)
    admit(kv, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert kv.get_computed_blocks(req("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]))[1] == 0  # chain breaks at block 0
    assert kv.get_computed_blocks(req("c", [1, 2, 3, 4, 0, 6, 7, 8, 9]))[1] == 4
    assert kv.get_computed_blocks(req("d", [1, 2, 3, 4, 5, 6, 7, 8, 9], lora_id=3))[1] == 0
    assert kv.get_computed_blocks(req("e", [1, 2, 3, 4, 5, 6, 7, 8, 9], prompt_logprobs=1))[1] == 0


def test_no_prefix_caching():
    kv = KVCacheManager(20, BS, enable_prefix_caching=False)
    admit(kv, req("a", range(9)))
    assert kv.get_computed_blocks(req("b", range(9))) == ([], 0)
    assert kv.num_cached_blocks == 0 and kv.prefix_cache_queries == 0


def test_freed_blocks_stay_cached_and_are_evicted_lru():
    kv = KVCacheManager(7, BS)  # 6 usable blocks
    a = req("a", range(13))  # blocks: 3 full + 1 partial
    admit(kv, a)
    a_blocks = kv.get_block_ids("a")
    kv.free(a)
    assert kv.num_free_blocks == 6 and kv.num_cached_blocks == 3
    # still a hit after being freed
    assert kv.get_computed_blocks(req("x", range(13)))[1] == 12
    # the partial (unkeyed) block went to the head: reused first, evicting nothing
    b = req("b", range(100, 102))
    assert admit(kv, b)[2] == [a_blocks[3]]
    assert kv.num_cached_blocks == 3
    # the next allocations evict a's tail block first (freed in reverse), then the middle one
    c = req("c", range(200, 208))  # 2 blocks: the 2 never-used blocks
    admit(kv, c)
    assert kv.get_computed_blocks(req("w", range(13)))[1] == 12
    d = req("d", range(300, 302))
    assert admit(kv, d)[2] == [a_blocks[2]]
    assert kv.get_computed_blocks(req("y", range(13)))[1] == 8
    e = req("e", range(400, 402))
    assert admit(kv, e)[2] == [a_blocks[1]]
    assert kv.get_computed_blocks(req("z", range(13)))[1] == 4
    kv.check_consistency()


def test_lru_order_across_requests():
    kv = KVCacheManager(5, BS)  # 4 usable
    a, b = req("a", range(5)), req("b", range(50, 55))  # each: 1 keyed block + 1 partial
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    kv.free(b)  # a was freed first: evicted first
    e = req("e", range(90, 102))  # 3 blocks: both partial blocks, then a's keyed block
    admit(kv, e)
    assert kv.get_computed_blocks(req("a2", range(5)))[1] == 0
    assert kv.get_computed_blocks(req("b2", range(50, 55)))[1] == 4
    kv.check_consistency()


def test_hit_takes_block_out_of_the_free_queue():
    kv = KVCacheManager(5, BS)  # 4 usable
    a, b = req("a", range(5)), req("b", range(50, 55))
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    kv.free(b)
    a2 = req("a2", range(5))
    assert admit(kv, a2)[1] == 4  # a's keyed block is in use again: it cannot be evicted
    e = req("e", range(90, 98))  # 2 blocks: a partial one, then b's keyed block
    assert admit(kv, e)[2] is not None
    assert kv.get_computed_blocks(req("b2", range(50, 55)))[1] == 0
    assert kv.get_computed_blocks(req("a3", range(5)))[1] == 4
    kv.check_consistency()


def test_hit_on_free_block_counts_against_free_space():
    kv = KVCacheManager(4, BS)  # 3 usable
    a = req("a", range(9))
    admit(kv, a)
    kv.free(a)  # 2 keyed free blocks + 1 unkeyed
    b = req("b", range(13))  # hits 8 tokens (2 free blocks), needs 2 more: only 1 free once the hits are taken
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8
    assert kv.allocate_slots(b, 5, blocks) is None
    kv.check_consistency()
    assert kv.allocate_slots(b, 4, blocks) is not None  # 12 tokens: 3 blocks
    kv.check_consistency()


def test_output_tokens_fill_blocks_that_become_cached():
    kv = KVCacheManager(20, BS)
    a = req("a", range(3))
    admit(kv, a)
    for t in range(10, 16):  # decode: the block fills with generated tokens
        a.append_output_token(t)
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    # tokens 0..8 known, 0..8 computed: 2 full blocks keyed
    assert kv.num_cached_blocks == 2
    kv.free(a)
    b = req("b", [0, 1, 2, 10, 11, 12, 13, 14, 15])
    assert kv.get_computed_blocks(b)[1] == 8


def test_duplicate_content_is_not_cached_twice():
    kv = KVCacheManager(20, BS)
    a, b = req("a", range(8)), req("b", range(8))
    kv.allocate_slots(a, 8)  # both allocate before either is cached: no hit for b
    kv.allocate_slots(b, 8)
    assert kv.num_cached_blocks == 2
    kv.free(a)
    kv.free(b)
    kv.check_consistency()
    assert kv.num_free_blocks == 19


def test_reset_prefix_cache():
    kv = KVCacheManager(20, BS)
    a = req("a", range(9))
    admit(kv, a)
    assert kv.reset_prefix_cache() is False  # blocks in use
    assert kv.num_cached_blocks == 2
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.num_cached_blocks == 0
    assert kv.get_computed_blocks(req("b", range(9)))[1] == 0
    kv.check_consistency()


def test_blocks_that_held_a_prefix_are_reused_first_after_a_reset():
    """Their pages have been written; blocks never used may still be untouched (lazy) memory."""
    kv = KVCacheManager(20, BS)
    a = req("a", range(3 * BS))
    admit(kv, a)
    used = kv.get_block_ids("a")
    kv.free(a)  # hashed: to the tail of the queue, behind the never-used blocks
    assert kv.reset_prefix_cache() is True
    b = req("b", range(1000, 1000 + 3 * BS))
    admit(kv, b)
    assert sorted(kv.get_block_ids("b")) == sorted(used)
    kv.check_consistency()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["alloc", "grow", "free"]), st.integers(0, 5), st.integers(1, 12)),
        max_size=80,
    )
)
def test_random_alloc_free_keeps_pool_consistent(ops):
    kv = KVCacheManager(9, BS)
    live: dict[int, Request] = {}
    serial = 0
    for op, slot, n in ops:
        if op == "alloc" and slot not in live:
            serial += 1
            # few distinct prompts: many shared prefixes
            r = req(f"r{serial}", [slot % 3] * n + [serial % 2])
            blocks, hit = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, r.num_tokens - hit, blocks) is not None:
                r.num_computed_tokens = r.num_tokens
                live[slot] = r
            else:
                assert r.request_id not in kv.req_blocks
        elif op == "grow" and slot in live:
            r = live[slot]
            for _ in range(n % 5):
                r.append_output_token(n)
            todo = r.num_tokens - r.num_computed_tokens
            if todo and kv.allocate_slots(r, todo) is not None:
                r.num_computed_tokens = r.num_tokens
        elif op == "free" and slot in live:
            kv.free(live.pop(slot))
        kv.check_consistency()
    for r in live.values():
        kv.free(r)
    kv.check_consistency()
    assert kv.num_free_blocks == 8 and kv.usage == 0.0
