"""The front end's side of the process boundary: start the engine cores, talk to them over ZMQ.

    client = EngineCoreClient(config)            # spawns the core(s), handshake, blocks until READY
    client.start(loop, on_outputs, on_dead)      # deliver outputs and death on the asyncio loop
    client.add_request(EngineCoreRequest(...))   # non-blocking sends, from the loop's thread
    client.abort_requests(["id"])
    await client.call_utility("get_stats", timeout=5)
    client.shutdown()

Data parallel (data_parallel_size = N): N engine-core processes, ranks 0..N-1, each with its own
model replica, KV cache and scheduler on its own slice of the devices (dp_devices.py), all on the
same two sockets. A new request goes to the least loaded rank (dp_load_balancer.py), an abort to the
rank that holds the request, a utility call to one rank or to every rank (call_utility_all). Any
rank dying is the engine dying.

Wave mode (dp_core_proc.py): the front end follows the wave the ranks run. A request that arrives
when the last wave is over first sends START_WAVE to every rank, and so does a rank's start_wave
message (a request reached it after its wave ended). The waves' all-reduce runs in a coordinator
thread (dp_coordinator.py).

Two threads watch the cores: one receives output messages (and the ENGINE_CORE_DEAD sentinel), one
waits on the process sentinels. Either hands the news to the event loop with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import time
from typing import Any, Callable

import zmq

from tokenmill.config import EngineConfig
from tokenmill.engine import messages as m
from tokenmill.engine.core_proc import run_engine_core
from tokenmill.engine.dp_coordinator import WaveCoordinator
from tokenmill.engine.dp_devices import rank_visible_devices
from tokenmill.engine.dp_load_balancer import RankLoads

logger = logging.getLogger(__name__)

POLL_S = 0.1
DEAD_CORE_GRACE_S = 0.5  # how long a dead core's last message may take to arrive


class EngineDeadError(RuntimeError):
    """The engine core process died or reported a fatal error: every in-flight request fails with it."""


class EngineStartupError(RuntimeError):
    """The engine core could not start (its one-line reason is the message)."""


class EngineCoreClient:
    def __init__(self, config: EngineConfig, enable_prefix_caching: bool = True,
                 startup_timeout_s: float = 600.0, target: Callable[..., None] = run_engine_core,
                 wave_mode: bool = False):
        """`target`: the engine-core process's entry point, with run_engine_core's arguments (tests
        substitute one that fails); `wave_mode`: the ranks step in lock-step waves."""
        self.num_ranks = config.parallel.data_parallel_size
        self.wave_mode = wave_mode
        self.on_ray = config.parallel.data_parallel_backend == "ray"
        self._ray_cores = None  # RayEngineCores, with the ray backend
        self._tmpdir = tempfile.mkdtemp(prefix="tokenmill-")
        if self.on_ray:  # cores anywhere in the cluster: TCP on this host's address, ports chosen at bind
            import ray

            from tokenmill import envs
            from tokenmill.executor.ray_cluster import connect

            connect(envs.TOKENMILL_RAY_DEVICE_RESOURCE,
                    local_devices=self.num_ranks * config.parallel.tensor_parallel_size)
            config = config.with_absolute_model_path()  # the cores' working directories are Ray's
            where = {name: f"tcp://{ray.util.get_node_ip_address()}:*" for name in ("input", "output", "coordinator")}
        else:
            where = {name: f"ipc://{self._tmpdir}/{name}" for name in ("input", "output", "coordinator")}
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone core raises
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.bind(where["input"])
        self.input_address = self.input_socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        self.output_socket.bind(where["output"])
        self.output_address = self.output_socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.coordinator: WaveCoordinator | None = None
        coordinator_address = None
        if wave_mode:
            self.coordinator = WaveCoordinator(self.ctx, where["coordinator"], self.num_ranks)
            coordinator_address = self.coordinator.address
        self.encoder = m.encoder()
        self._call_ids = itertools.count()
        self._pending_calls: dict[int, asyncio.Future] = {}
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead_reported = False
        self._loads = RankLoads(self.num_ranks)
        self._rank_of: dict[str, int] = {}  # requests sent and not seen finished → their rank
        self.wave = 0  # wave mode: the wave the ranks run, or the next one
        self.wave_running = False
        self.procs: list = []  # multiprocessing.Process, or RayEngineCore with the ray backend
        try:
            if self.on_ray:
                from tokenmill.executor.ray_engine_cores import RayEngineCores

                self._ray_cores = RayEngineCores(self.num_ranks, config.parallel.tensor_parallel_size)
            spawn = multiprocessing.get_context("spawn")
            for rank in range(self.num_ranks):
                name = "EngineCore" if self.num_ranks == 1 else f"EngineCore-DP{rank}"
                if self._ray_cores is not None:
                    self.procs.append(self._ray_cores.core(rank, name, self.input_address, coordinator_address))
                    continue
                args = (self.input_address, os.getpid(), rank, rank_visible_devices(rank, config.parallel),
                        coordinator_address)
                self.procs.append(spawn.Process(target=target, args=args, name=name, daemon=True))
            for proc in self.procs:
                proc.start()
            if self.coordinator is not None:
                self.coordinator.start()
            self.ready = self._handshake(config, enable_prefix_caching, startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    @property
    def pid(self) -> int | None:
        """Rank 0's process id."""
        return self.procs[0].pid if self.procs else None

    @property
    def pids(self) -> list[int | None]:
        return [proc.pid for proc in self.procs]

    @property
    def num_blocks(self) -> int:
        """KV blocks of the smallest rank's cache: what one request can count on."""
        return min(r.num_blocks for r in self.ready)

    @property
    def block_size(self) -> int:
        return self.ready[0].block_size

    def _rank_label(self, rank: int) -> str:
        return "" if self.num_ranks == 1 else f" (data-parallel rank {rank})"

    # ---- start-up -----------------------------------------------------------------------------------

    def _recv_handshake(self, deadline: float, what: str) -> tuple[int, m.HandshakeMessage]:
        while not self.input_socket.poll(int(POLL_S * 1000)):
            for rank, proc in enumerate(self.procs):
                # a core that failed sends its reason, then exits: the reason may land between the
                # poll above and this check, so look once more before reporting a bare exit
                if not proc.is_alive() and not self.input_socket.poll(int(DEAD_CORE_GRACE_S * 1000)):
                    raise EngineStartupError(
                        f"the engine core{self._rank_label(rank)} exited (code {proc.exitcode}) while {what}")
            if time.monotonic() > deadline:
                raise EngineStartupError(f"the engine core did not answer in time while {what}")
        identity, payload = self.input_socket.recv_multipart()
        return int.from_bytes(identity, "little"), m.decoder(m.HandshakeMessage).decode(payload)

    def _handshake(self, config: EngineConfig, prefix_caching: bool, timeout_s: float) -> list[m.HandshakeReady]:
        """Every rank: HELLO → init (the ranks then load in parallel) → READY. One failure fails all."""
        deadline = time.monotonic() + timeout_s
        for _ in range(self.num_ranks):
            rank, hello = self._recv_handshake(deadline, "starting")
            if not isinstance(hello, m.HandshakeHello) or hello.rank != rank or rank >= self.num_ranks:
                raise EngineStartupError(f"unexpected handshake message {type(hello).__name__} from rank {rank}")
            # each rank draws its own seeds for unseeded requests
            rank_config = config if rank == 0 else config.replace(seed=config.seed + rank)
            init = m.HandshakeInit(self.output_address, rank_config, prefix_caching)
            self.input_socket.send_multipart([m.rank_identity(rank), self.encoder.encode(init)])
        ready: dict[int, m.HandshakeReady] = {}
        while len(ready) < self.num_ranks:
            rank, reply = self._recv_handshake(deadline, "loading the model")
            if isinstance(reply, m.HandshakeFailed):
                self.procs[rank].join(timeout=5)
                where = "" if self.num_ranks == 1 else f"data-parallel rank {rank}: "
                raise EngineStartupError(where + reply.message)
            if not isinstance(reply, m.HandshakeReady):
                raise EngineStartupError(f"unexpected handshake message {type(reply).__name__}")
            where = f" on Ray node {self.procs[rank].node_ip}" if self.on_ray else ""
            logger.info("engine core%s ready (pid %d%s, %d KV blocks)", self._rank_label(rank),
                        self.procs[rank].pid, where, reply.num_blocks)
            ready[rank] = reply
        return [ready[rank] for rank in range(self.num_ranks)]

    def start(self, loop: asyncio.AbstractEventLoop, on_outputs: Callable[[m.EngineCoreOutputs], None],
              on_dead: Callable[[str], None]) -> None:
        """Start delivering outputs (and the core's death) to callbacks run on `loop`."""
        self._loop = loop
        self._on_outputs, self._on_dead = on_outputs, on_dead
        for target, name in ((self._output_thread, "output"), (self._monitor_thread, "monitor")):
            t = threading.Thread(target=target, name=f"EngineCoreClient-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    # ---- the watchers -------------------------------------------------------------------------------

    def _output_thread(self) -> None:
        decoder = m.decoder(m.EngineCoreOutputs)
        sock = self.output_socket
        try:
            while not self._stopping.is_set():
                if not sock.poll(int(POLL_S * 1000)):
                    continue
                frame = sock.recv(copy=False)
                if frame.bytes == m.ENGINE_CORE_DEAD:
                    self._report_dead("the engine core reported a fatal error (see its log)")
                    return
                outputs = decoder.decode(frame.buffer)
                self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except Exception as e:  # noqa: BLE001
            if not self._stopping.is_set():
                logger.exception("engine output thread failed")
                self._report_dead(f"the engine output channel failed: {e}")

    def _monitor_thread(self) -> None:
        """Waits for the cores to exit and reaps them: the one thread that waits on the processes
        once started (two threads in waitpid would race), so shutdown() waits on this thread instead."""
        alive = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        while alive:
            for sentinel in multiprocessing.connection.wait(list(alive), timeout=0.5):
                rank = alive.pop(sentinel)
                proc = self.procs[rank]
                proc.join()  # it has exited: this returns at once
                if not self._stopping.is_set():
                    self._report_dead(
                        f"the engine core process died (exit code {proc.exitcode}){self._rank_label(rank)}")

    def _dispatch(self, outputs: m.EngineCoreOutputs) -> None:
        rank = outputs.engine_index
        if outputs.counts is not None:
            self._loads.on_counts(rank, outputs.counts)
        for out in outputs.outputs:
            if out.finished:
                self._rank_of.pop(out.req_id, None)
        if outputs.wave_complete is not None and outputs.wave_complete >= self.wave:
            self.wave, self.wave_running = outputs.wave_complete + 1, False
        if outputs.start_wave is not None:
            try:
                self._start_wave(outputs.start_wave)
            except EngineDeadError:  # reported already
                pass
        res = outputs.utility_output
        if res is not None:
            fut = self._pending_calls.pop(res.call_id, None)
            if fut is not None and not fut.done():
                if res.failure_message is not None:
                    fut.set_exception(RuntimeError(res.failure_message))
                else:
                    fut.set_result(res.result)
        if outputs.outputs:
            self._on_outputs(outputs)

    def _report_dead(self, reason: str) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._dead_on_loop, reason)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _dead_on_loop(self, reason: str) -> None:
        if self._dead_reported or self._stopping.is_set():
            return
        self._dead_reported = True
        logger.error("%s", reason)
        for fut in self._pending_calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self._pending_calls.clear()
        self._on_dead(reason)

    # ---- requests -----------------------------------------------------------------------------------

    def _send(self, rank: int, kind: m.RequestType, payload: Any) -> None:
        try:
            self.input_socket.send_multipart(
                [m.rank_identity(rank), kind.value, self.encoder.encode(payload)], flags=zmq.NOBLOCK
            )
        except zmq.ZMQError as e:  # EHOSTUNREACH: the core is gone
            reason = f"cannot reach the engine core{self._rank_label(rank)}: {e}"
            self._report_dead(reason)
            raise EngineDeadError(reason) from None

    def add_request(self, request: m.EngineCoreRequest, rank: int | None = None) -> int:
        """Send a request to `rank` (default: the least loaded one); returns the rank."""
        if rank is None:
            rank = self._loads.pick()
        if self.wave_mode and not self.wave_running:
            self._start_wave(self.wave)
        self._send(rank, m.RequestType.ADD, request)
        self._loads.on_sent(rank)
        self._rank_of[request.request_id] = rank
        return rank

    def rank_of(self, request_id: str) -> int | None:
        """The rank holding a request that was sent and not seen finished (None for any other)."""
        return self._rank_of.get(request_id)

    def _start_wave(self, wave: int) -> None:
        """Every rank steps wave `wave` (a rank already stepping it ignores this)."""
        if wave < self.wave or (wave == self.wave and self.wave_running):
            return
        self.wave, self.wave_running = wave, True
        for rank in range(self.num_ranks):
            self._send(rank, m.RequestType.START_WAVE, wave)

    def abort_requests(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self._rank_of.pop(request_id, None)
            if rank is not None:  # else: already finished in its core
                by_rank.setdefault(rank, []).append(request_id)
        for rank, ids in by_rank.items():
            self._send(rank, m.RequestType.ABORT, ids)

    async def call_utility(self, method: str, *args, timeout: float = 10.0, rank: int = 0) -> Any:
        """Run an engine-core method by name (EngineCoreProc.utility_methods) on one rank; raises on
        failure or timeout."""
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = fut
        try:
            self._send(rank, m.RequestType.UTILITY, m.UtilityCall(call_id, method, tuple(args)))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"engine core utility call {method!r} timed out after {timeout} s"
                               f"{self._rank_label(rank)}") from None
        finally:
            self._pending_calls.pop(call_id, None)

    async def call_utility_all(self, method: str, *args, timeout: float = 10.0) -> list[Any]:
        """call_utility on every rank at once: the results by rank."""
        calls = (self.call_utility(method, *args, timeout=timeout, rank=rank) for rank in range(self.num_ranks))
        return list(await asyncio.gather(*calls))

    # ---- shutdown -----------------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the cores (SIGTERM, then SIGKILL after timeout_s), the threads and the sockets."""
        self._stopping.set()
        started = [proc for proc in self.procs if proc.pid is not None]
        monitor = next((t for t in self._threads if t.name.endswith("monitor")), None)

        def exited(timeout: float) -> bool:
            if monitor is not None:  # the monitor reaps the processes
                monitor.join(timeout)
                return not monitor.is_alive()
            deadline = time.monotonic() + timeout
            for proc in started:
                proc.join(max(0.0, deadline - time.monotonic()))
            return not any(proc.is_alive() for proc in started)

        def signal_all(how: str) -> None:  # "terminate": SIGTERM (a clean stop), "kill": SIGKILL
            for proc in started:
                try:
                    getattr(proc, how)()
                except Exception:  # noqa: BLE001 - already gone
                    pass

        if not exited(0):
            signal_all("terminate")
            if not exited(timeout_s):
                logger.warning("engine core did not stop within %.0f s; killing it", timeout_s)
                signal_all("kill")
                exited(5)
        if self._ray_cores is not None:
            self._ray_cores.close()
        for t in self._threads:
            t.join(timeout=1.0)
        if self.coordinator is not None:
            self.coordinator.close()
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
