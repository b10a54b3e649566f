"""The wave collective of data-parallel engine cores: an all-reduce (logical OR) of "I have work".

Ranks that serve one expert-parallel MoE model step in lock-step waves (dp_core_proc.py): every rank
runs one forward per step, a dummy one when it has nothing to do. Every WAVE_SYNC_STEPS steps of a
wave each rank sends WaveSync(wave, sync_point, has_work) to the coordinator and blocks; once all N
ranks have voted at that (wave, sync_point), the coordinator answers each of them with the OR of the
votes. Every rank gets the same answer at the same step, so they all end the wave together.

The coordinator is a thread of the front-end process with its own ROUTER socket, so it answers even
while the asyncio loop is busy; each rank connects a DEALER whose identity is its rank.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from tokenmill.config import ModelConfig, ParallelConfig
from tokenmill.engine import messages as m

logger = logging.getLogger(__name__)

# Steps of a wave between two all-reduces (vLLM's interval): a wave outlives its last request by
# fewer than this many steps, and the ranks synchronise this rarely.
WAVE_SYNC_STEPS = 32
POLL_S = 0.1


def uses_waves(parallel: ParallelConfig, model: ModelConfig) -> bool:
    """Ranks step in waves when they serve one expert-parallel MoE model: its experts' collectives
    need every rank in every forward."""
    return model.is_moe and parallel.enable_expert_parallel and parallel.data_parallel_size > 1


class WaveCoordinator:
    """The front end's side: collects the votes of one sync point and answers with their OR."""

    def __init__(self, ctx: zmq.Context, address: str, num_ranks: int):
        """`address` may leave the port to the system (tcp://host:*): `self.address` is where it is."""
        self.num_ranks = num_ranks
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.num_reductions = 0
        self._votes: dict[tuple[int, int], dict[bytes, bool]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="WaveCoordinator", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        decoder, encoder = m.decoder(m.WaveSync), m.encoder()
        sock = self.socket
        try:
            while not self._stop.is_set():
                if not sock.poll(int(POLL_S * 1000)):
                    continue
                identity, payload = sock.recv_multipart()
                vote = decoder.decode(payload)
                key = (vote.wave, vote.sync_point)
                votes = self._votes.setdefault(key, {})
                votes[identity] = vote.has_work
                if len(votes) < self.num_ranks:
                    continue
                del self._votes[key]
                result = encoder.encode(m.WaveSyncResult(vote.wave, vote.sync_point, any(votes.values())))
                for rank_identity in votes:
                    sock.send_multipart([rank_identity, result])
                self.num_reductions += 1
        except Exception:  # noqa: BLE001 - the ranks then time out waiting and report it
            if not self._stop.is_set():
                logger.exception("the wave coordinator failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        self.socket.close(linger=0)


class WaveSyncClient:
    """A rank's side: vote and wait for the answer."""

    def __init__(self, ctx: zmq.Context, address: str, rank: int, timeout_s: float):
        self.rank = rank
        self.timeout_s = timeout_s
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, m.rank_identity(rank))
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self._encoder = m.encoder()
        self._decoder = m.decoder(m.WaveSyncResult)

    def any_work(self, wave: int, sync_point: int, has_work: bool, stop: threading.Event) -> bool | None:
        """Does any rank have work at this sync point? Blocks until every rank has voted; None if
        `stop` was set meanwhile. A peer that never comes is fatal after `timeout_s`."""
        self.socket.send(self._encoder.encode(m.WaveSync(wave, sync_point, has_work)))
        deadline = time.monotonic() + self.timeout_s
        while not self.socket.poll(int(POLL_S * 1000)):
            if stop.is_set():
                return None
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"data-parallel rank {self.rank}: the other ranks did not reach sync point {sync_point} of "
                    f"wave {wave} within {self.timeout_s:.0f} s"
                )
        result = self._decoder.decode(self.socket.recv())
        if (result.wave, result.sync_point) != (wave, sync_point):
            raise RuntimeError(
                f"data-parallel rank {self.rank}: the ranks lost step (answer for wave {result.wave} sync "
                f"point {result.sync_point}, expected wave {wave} sync point {sync_point})"
            )
        return result.any_work

    def close(self) -> None:
        self.socket.close(linger=0)
