"""Which data-parallel rank takes the next request: the one with the fewest queued + running requests."""

from __future__ import annotations

from tokenmill.engine import messages as m


class RankLoads:
    """A rank's load = waiting + running in its latest published counts, plus the requests sent to it
    that it had not received yet when it published them (still on the socket). Counting what was
    sent keeps a burst of requests, added before any rank answers, spread evenly. Ties go to the
    lowest rank. Messages from one rank arrive in order, so its latest counts are its newest."""

    def __init__(self, num_ranks: int):
        self._queued = [0] * num_ranks  # waiting + running, as last published
        self._received = [0] * num_ranks  # requests received, as last published
        self._sent = [0] * num_ranks

    def load(self, rank: int) -> int:
        return self._queued[rank] + self._sent[rank] - self._received[rank]

    def pick(self) -> int:
        return min(range(len(self._sent)), key=lambda rank: (self.load(rank), rank))

    def on_sent(self, rank: int) -> None:
        self._sent[rank] += 1

    def on_counts(self, rank: int, counts: m.RankCounts) -> None:
        self._queued[rank] = counts.num_waiting + counts.num_running
        self._received[rank] = counts.num_received
