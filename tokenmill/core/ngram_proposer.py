"""N-gram (prompt lookup) proposals for speculative decoding: no draft model, only the context.

If the context's last n tokens occurred earlier, the tokens that followed that occurrence are a
likely continuation (quoted spans, code, lists, and the loops small models fall into). The latest
earlier occurrence wins, and longer n-grams are tried first. The continuation is copied as a
shift: the token d positions back predicts the next, d the distance to the occurrence, so a
proposal may run on past the end of the context into tokens it proposed itself (a loop of period
d continues for all k tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens, for the
    largest n in [min_n, max_n] that has one; [] if none does."""
    a = np.asarray(tokens, np.int64)
    total = len(a)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = a[total - n:]
        # starts of the n-grams ending before the last token (an occurrence must have a follower)
        windows = np.lib.stride_tricks.sliding_window_view(a[: total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            proposal = a[start : start + k].tolist()
            while len(proposal) < k:  # copy on past the end: the shift goes on
                proposal.append(proposal[len(proposal) - (total - start)])
            return proposal
    return []
