"""The front end's side of the process boundary: start the engine core, talk to it over ZMQ.

    client = EngineCoreClient(config)            # spawns the core, handshake, blocks until READY
    client.start(loop, on_outputs, on_dead)      # deliver outputs and death on the asyncio loop
    client.add_request(EngineCoreRequest(...))   # non-blocking sends, from the loop's thread
    client.abort_requests(["id"])
    await client.call_utility("get_stats", timeout=5)
    client.shutdown()

Two threads watch the core: one receives output messages (and the ENGINE_CORE_DEAD sentinel), one
waits on the process sentinel. Either hands the news to the event loop with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading
import time
from typing import Any, Callable

import zmq

from tokenmill.config import EngineConfig
from tokenmill.engine import messages as m
from tokenmill.engine.core_proc import run_engine_core

logger = logging.getLogger(__name__)

POLL_S = 0.1


class EngineDeadError(RuntimeError):
    """The engine core process died or reported a fatal error: every in-flight request fails with it."""


class EngineStartupError(RuntimeError):
    """The engine core could not start (its one-line reason is the message)."""


class EngineCoreClient:
    def __init__(self, config: EngineConfig, enable_prefix_caching: bool = True,
                 startup_timeout_s: float = 600.0, target: Callable[[str, int], None] = run_engine_core):
        """`target`: the engine-core process's entry point (tests substitute one that fails)."""
        self._tmpdir = tempfile.mkdtemp(prefix="tokenmill-")
        self.input_address = f"ipc://{self._tmpdir}/input"
        self.output_address = f"ipc://{self._tmpdir}/output"
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone core raises
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.bind(self.input_address)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        self.output_socket.bind(self.output_address)
        self.encoder = m.encoder()
        self._identity: bytes | None = None
        self._call_ids = itertools.count()
        self._pending_calls: dict[int, asyncio.Future] = {}
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead_reported = False
        self.proc = multiprocessing.get_context("spawn").Process(
            target=target, args=(self.input_address, os.getpid()), name="EngineCore", daemon=True
        )
        try:
            self.proc.start()
            self.ready = self._handshake(config, enable_prefix_caching, startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    # ---- start-up -----------------------------------------------------------------------------------

    def _recv_handshake(self, deadline: float, what: str):
        while not self.input_socket.poll(int(POLL_S * 1000)):
            if not self.proc.is_alive():
                raise EngineStartupError(f"the engine core exited (code {self.proc.exitcode}) while {what}")
            if time.monotonic() > deadline:
                raise EngineStartupError(f"the engine core did not answer in time while {what}")
        identity, payload = self.input_socket.recv_multipart()
        return identity, m.decoder(m.HandshakeMessage).decode(payload)

    def _handshake(self, config: EngineConfig, prefix_caching: bool, timeout_s: float) -> m.HandshakeReady:
        deadline = time.monotonic() + timeout_s
        identity, hello = self._recv_handshake(deadline, "starting")
        if not isinstance(hello, m.HandshakeHello):
            raise EngineStartupError(f"unexpected handshake message {type(hello).__name__}")
        self._identity = identity
        init = m.HandshakeInit(self.output_address, config, prefix_caching)
        self.input_socket.send_multipart([identity, self.encoder.encode(init)])
        _, reply = self._recv_handshake(deadline, "loading the model")
        if isinstance(reply, m.HandshakeFailed):
            self.proc.join(timeout=5)
            raise EngineStartupError(reply.message)
        if not isinstance(reply, m.HandshakeReady):
            raise EngineStartupError(f"unexpected handshake message {type(reply).__name__}")
        logger.info("engine core ready (pid %d, %d KV blocks)", self.proc.pid, reply.num_blocks)
        return reply

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
        """Waits for the core to exit and reaps it: the one thread that waits on the process once
        started (two threads in waitpid would race), so shutdown() waits on this thread instead."""
        while not multiprocessing.connection.wait([self.proc.sentinel], timeout=0.5):
            pass
        self.proc.join()  # it has exited: this returns at once
        if not self._stopping.is_set():
            self._report_dead(f"the engine core process died (exit code {self.proc.exitcode})")

    def _dispatch(self, outputs: m.EngineCoreOutputs) -> None:
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

    def _send(self, kind: m.RequestType, payload: Any) -> None:
        try:
            self.input_socket.send_multipart(
                [self._identity, kind.value, self.encoder.encode(payload)], flags=zmq.NOBLOCK
            )
        except zmq.ZMQError as e:  # EHOSTUNREACH: the core is gone
            self._report_dead(f"cannot reach the engine core: {e}")
            raise EngineDeadError(f"cannot reach the engine core: {e}") from None

    def add_request(self, request: m.EngineCoreRequest) -> None:
        self._send(m.RequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(m.RequestType.ABORT, list(request_ids))

    async def call_utility(self, method: str, *args, timeout: float = 10.0) -> Any:
        """Run an engine-core method by name (core_proc.UTILITY_METHODS); raises on failure or timeout."""
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = fut
        try:
            self._send(m.RequestType.UTILITY, m.UtilityCall(call_id, method, tuple(args)))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"engine core utility call {method!r} timed out after {timeout} s") from None
        finally:
            self._pending_calls.pop(call_id, None)

    # ---- shutdown -----------------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the core (SIGTERM, then SIGKILL after timeout_s), the threads and the sockets."""
        self._stopping.set()
        proc = self.proc
        monitor = next((t for t in self._threads if t.name.endswith("monitor")), None)

        def exited(timeout: float) -> bool:
            if monitor is not None:  # the monitor reaps the process
                monitor.join(timeout)
                return not monitor.is_alive()
            proc.join(timeout)
            return not proc.is_alive()

        if proc.pid is not None and not exited(0):
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            if not exited(timeout_s):
                logger.warning("engine core did not stop within %.0f s; killing it", timeout_s)
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                exited(5)
        for t in self._threads:
            t.join(timeout=1.0)
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
