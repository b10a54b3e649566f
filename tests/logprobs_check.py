"""Comparing logprobs across runs whose steps were cut differently (another compiled program: float32 rounding)."""

from __future__ import annotations


def close_logprobs(a, b, tol=1e-4) -> bool:
    """The same top tokens at each position, logprobs within `tol`."""
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) <= tol for t in x) for x, y in zip(a, b)
    )
