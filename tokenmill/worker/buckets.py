"""Shape buckets: the short lists of padded sizes the runner compiles for."""

from __future__ import annotations

import bisect

MIN_TOKEN_BUCKET = 1  # single-stream decode: XLA:CPU pays for every padded row (93 ms at 1 token, 188 at 16)
MIN_BLOCK_BUCKET = 8


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pow2_series(low: int, high: int) -> list[int]:
    sizes = []
    size = low
    while size < high:
        sizes.append(size)
        size *= 2
    sizes.append(high)
    return sizes


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Scheduled-token counts: powers of two up to the token budget (which is the last bucket)."""
    return _pow2_series(min(MIN_TOKEN_BUCKET, max_num_batched_tokens), max_num_batched_tokens)


def block_buckets(max_blocks_per_req: int) -> list[int]:
    """Block-table widths (context length in blocks): powers of two up to max_model_len's."""
    return _pow2_series(min(MIN_BLOCK_BUCKET, max_blocks_per_req), max_blocks_per_req)


def pick_bucket(buckets: list[int], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]
