"""N-gram (prompt lookup) proposals, against a plain-Python statement of the rule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.core.ngram_proposer import propose_ngram


def reference(tokens, min_n, max_n, k):
    """The longest n in [min_n, max_n] whose last-n suffix occurred earlier (with a follower); the
    latest such occurrence; then copy on from it, shift by shift."""
    total = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= total:
            continue
        for i in range(total - n - 1, -1, -1):
            if tokens[i : i + n] == tokens[total - n :]:
                out = list(tokens)
                for _ in range(k):
                    out.append(out[len(out) - (total - i - n)])
                return out[total:]
    return []


@pytest.mark.parametrize(
    "tokens, min_n, max_n, k, expected",
    [
        ([1, 2, 3, 4, 1, 2], 1, 3, 4, [3, 4, 1, 2]),
        ([5, 7, 7, 7, 7], 2, 4, 5, [7, 7, 7, 7, 7]),  # a one-token loop continues for all k
        ([1, 2, 3, 9, 8, 1, 2], 2, 2, 2, [3, 9]),
        ([1, 2, 9, 1, 3, 1, 2], 2, 3, 2, [9, 1]),  # the longer match wins over the later 1-gram
        ([4, 1, 5, 1, 6, 1], 1, 1, 1, [6]),  # the latest occurrence of "1"
        ([1, 2, 3], 2, 4, 3, []),
        ([1], 1, 4, 3, []),
    ],
)
def test_examples(tokens, min_n, max_n, k, expected):
    assert propose_ngram(tokens, min_n, max_n, k) == expected


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 3), st.integers(0, 3), st.integers(1, 6))
def test_matches_the_rule(tokens, min_n, extra, k):
    max_n = min_n + extra
    assert propose_ngram(tokens, min_n, max_n, k) == reference(tokens, min_n, max_n, k)
