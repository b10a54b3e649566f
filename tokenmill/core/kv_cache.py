"""The KV block pool and its prefix cache. Plain Python: block ids only, no device memory.

Blocks have a fixed number of token slots. Block 0 is the null block: never handed out, so a
runner may point padding at it. Every other block is either in use (ref count > 0, held by one or
more requests) or free (ref count 0, in the free queue).

A full block is keyed by a hash chained over (its parent block's hash, its token ids, extra keys
such as the LoRA id), so one key names one whole prefix. A block is registered in the cache when
the tokens that fill it are scheduled (the runner writes a step's KV before any attention reads
it, so a hit in the same step is sound). A freed block keeps its key: it is still a hit until it is
evicted. The free queue is in eviction order (LRU): allocation takes from its head and only then
drops the block's key. Freed blocks without a key go to the head (nothing is lost reusing them);
keyed blocks go to the tail, a request's blocks in reverse so its tail is evicted before its head.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from tokenmill.core.request import Request

NULL_BLOCK = 0
_ROOT_HASH = b"tokenmill-kv-root"


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: Hashable = None) -> bytes:
    """sha256 over (parent hash, token ids, extra keys), truncated to 16 bytes.

    Deterministic across processes (no Python hash randomisation) and collision-resistant, so one
    user's prompt cannot be crafted to hit another's blocks.
    """
    h = hashlib.sha256(parent_hash or _ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    if extra_keys is not None:
        h.update(repr(extra_keys).encode())
    return h.digest()[:16]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks  # including the null block
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # free blocks in eviction order, head first (insertion order; O(1) removal from the middle)
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.cached: dict[bytes, int] = {}  # block key -> block id
        self.req_blocks: dict[str, list[int]] = {}
        self.req_num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already keyed

        # stats, in tokens: counted once per admission (a request's first allocation)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- sizes ----------------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free, cached or not)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by requests."""
        return 1.0 - len(self.free_queue) / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def cdiv_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self.req_blocks.get(request_id, ()))

    # ---- hashing --------------------------------------------------------------------------------

    def _ensure_block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        num_full_blocks = min(num_full_blocks, len(tokens) // bs)
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full_blocks):
            parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], request.lora_id)
            hashes.append(parent)
        return hashes

    # ---- prefix cache ---------------------------------------------------------------------------

    def _lookup_enabled(self, request: Request) -> bool:
        # Prompt logprobs need every prompt position computed: no hits for such requests (as vLLM).
        return self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of the request's tokens: (block ids, number of tokens).

        The last token is always left to compute (its logits give the next token), so a fully
        cached sequence returns one block fewer. Touches nothing: pass the blocks to
        `allocate_slots` to take them.
        """
        if not self._lookup_enabled(request):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._ensure_block_hashes(request, max_blocks)
        blocks = []
        for h in hashes[:max_blocks]:
            b = self.cached.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks, len(blocks) * self.block_size

    # ---- allocation -----------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of the request.

        `new_computed_blocks` (from `get_computed_blocks`, on admission) extend the request's
        computed prefix: the tokens to hold are `request.num_computed_tokens +
        len(new_computed_blocks) * block_size + num_new_tokens`. Returns the ids of the freshly
        allocated blocks (not the hit blocks), or None, changing nothing, if too few blocks are free.
        """
        req_id = request.request_id
        bs = self.block_size
        hits = new_computed_blocks or ()
        held = self.req_blocks.get(req_id)
        total = request.num_computed_tokens + len(hits) * bs + num_new_tokens
        num_needed = -(-total // bs) - len(hits) - (len(held) if held is not None else 0)
        if num_needed <= 0 and not hits and held is not None:  # the common decode step
            if self.enable_prefix_caching and total // bs > self.req_num_cached_blocks[req_id]:
                self._cache_full_blocks(request, held, min(total, request.num_tokens))
            return []
        # hit blocks that are free leave the free queue when touched
        num_free_hits = sum(1 for b in hits if self.ref_cnt[b] == 0)
        if num_needed > len(self.free_queue) - num_free_hits:
            return None

        if held is None:
            held = self.req_blocks[req_id] = []
            self.req_num_cached_blocks[req_id] = 0
            if self._lookup_enabled(request):  # an admission: count the prefix-cache query
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(hits) * bs
        for b in hits:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1
        held.extend(hits)
        new_blocks = [self._take_free_block() for _ in range(num_needed)]
        held.extend(new_blocks)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, held, min(total, request.num_tokens))
        return new_blocks

    def _take_free_block(self) -> int:
        b, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:  # evict
            if self.cached.get(h) == b:
                del self.cached[h]
            self.block_hash[b] = None
        self.ref_cnt[b] = 1
        return b

    def _cache_full_blocks(self, request: Request, blocks: list[int], num_tokens: int) -> None:
        """Key the request's blocks that `num_tokens` known tokens fill."""
        req_id = request.request_id
        start = self.req_num_cached_blocks[req_id]
        num_full = num_tokens // self.block_size
        if num_full <= start:
            return
        hashes = self._ensure_block_hashes(request, num_full)
        for i in range(start, num_full):
            b = blocks[i]
            if self.block_hash[b] is not None:  # a hit block: keyed already
                continue
            h = hashes[i]
            if h not in self.cached:  # else the same content is cached in another block: leave this one unkeyed
                self.cached[h] = b
                self.block_hash[b] = h
        self.req_num_cached_blocks[req_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so the tail is evicted first). Idempotent."""
        blocks = self.req_blocks.pop(request.request_id, None)
        self.req_num_cached_blocks.pop(request.request_id, None)
        if not blocks:
            return
        for b in reversed(blocks):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False, nothing changed) while any block is in use.
        The blocks that held a prefix become plain free blocks, and like those (free()) go to the
        front of the queue, in their order: their pages have been written, where the blocks never
        used yet may still be untouched memory (the CPU cache is lazily mapped)."""
        if len(self.free_queue) != self.num_usable_blocks:
            return False
        held = [b for b in self.free_queue if self.block_hash[b] is not None]
        for b in reversed(held):
            self.free_queue.move_to_end(b, last=False)
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    # ---- checking -------------------------------------------------------------------------------

    def check_consistency(self) -> None:
        """Assert the pool's invariants (tests)."""
        assert self.ref_cnt[NULL_BLOCK] == 0 and NULL_BLOCK not in self.free_queue
        refs = [0] * self.num_blocks
        for blocks in self.req_blocks.values():
            assert len(set(blocks)) == len(blocks), "a request holds a block twice"
            for b in blocks:
                refs[b] += 1
        assert refs == self.ref_cnt, "ref counts differ from what requests hold"
        for b in range(1, self.num_blocks):
            assert self.ref_cnt[b] >= 0
            assert (self.ref_cnt[b] == 0) == (b in self.free_queue), f"block {b} free-queue mismatch"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h
        assert sum(h is not None for h in self.block_hash) == len(self.cached)
