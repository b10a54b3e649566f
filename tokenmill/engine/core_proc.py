"""EngineCoreProc: the EngineCore in its own (spawned) process, behind ZMQ sockets.

Two IO threads move bytes between the sockets and two queues, so the busy loop only steps:

    input thread:  DEALER (front end's ROUTER) → decode → input queue
    busy loop:     drain the input queue (adds, aborts, utility calls) → EngineCore.step() → output queue
    output thread: output queue → encode → PUSH (front end's PULL)

Aborts are applied as soon as the busy loop sees them, before the next step. A fatal error in the
loop sends ENGINE_CORE_DEAD and exits 1. SIGTERM/SIGINT stop the loop between steps and exit 0.
The process also exits if its parent dies (it polls os.getppid()).

Data parallel: each rank is one such process. Every message it sends carries its rank and its load
(RankCounts), and it sends its load alone when that changed with nothing else to carry it. Ranks in
wave mode run DPWaveEngineCoreProc (dp_core_proc.py) instead.

This module is imported by the front end (to name the process target), so it imports nothing heavy
at module level: JAX comes in with EngineCore, inside the child only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import sys
import threading
import time

import zmq

from tokenmill.engine import messages as m

logger = logging.getLogger("tokenmill.engine_core")

# How long to wait for the front end's HandshakeInit after HELLO.
HANDSHAKE_TIMEOUT_S = 60.0
# Idle wait granularity of the busy loop and the IO threads (checks for stop / parent death).
POLL_S = 0.1
# After the parent has died: how long to try to exit cleanly before os._exit.
ORPHAN_GRACE_S = 3.0

_STOP = object()


class EngineCoreProc:
    # Utility methods the front end may call by name.
    utility_methods = ("get_stats", "reset_prefix_cache", "num_unfinished_requests", "precompiling")

    def __init__(self, input_address: str, parent_pid: int | None, rank: int = 0):
        """`parent_pid`: the front end's pid, watched so that the core exits when it dies; None where
        something else owns the core's life (a Ray actor dies with the driver that created it)."""
        self.parent_pid = parent_pid
        self.rank = rank
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.DEALER)
        self.input_socket.setsockopt(zmq.IDENTITY, m.rank_identity(rank))
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.connect(input_address)
        self.output_socket: zmq.Socket | None = None
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.encoder = m.encoder()
        self.engine = None
        self.num_aborted = 0
        self.num_received = 0  # requests received in all (the front end's load balancing counts them)
        self._published_counts: m.RankCounts | None = None
        self._threads: list[threading.Thread] = []

    # ---- start-up ---------------------------------------------------------------------------------

    def handshake_and_start(self) -> bool:
        """HELLO → init → build the engine → READY (or FAILED). False if the core must exit."""
        decoder = m.decoder(m.HandshakeMessage)
        self.input_socket.send(self.encoder.encode(m.HandshakeHello(pid=os.getpid(), rank=self.rank)))
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        while not self.input_socket.poll(int(POLL_S * 1000)):
            if time.monotonic() > deadline or self._orphaned() or self.stop.is_set():
                logger.error("no handshake from the front end; exiting")
                return False
        init = decoder.decode(self.input_socket.recv())
        if not isinstance(init, m.HandshakeInit):
            logger.error("unexpected handshake message %s", type(init).__name__)
            return False
        try:
            from tokenmill.engine.core import EngineCore

            self.engine = EngineCore(init.engine_config, enable_prefix_caching=init.enable_prefix_caching, tokenizer=False)
        except Exception as e:  # noqa: BLE001 - any start-up failure goes back as one message
            if not isinstance(e, (ValueError, OSError)):  # expected failures carry a clear message
                logger.exception("engine core failed to start")
            message = str(e) or type(e).__name__
            self.input_socket.send(self.encoder.encode(m.HandshakeFailed(message=message)))
            return False
        self.output_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket.setsockopt(zmq.LINGER, 2000)
        self.output_socket.connect(init.output_address)
        cfg = init.engine_config
        ready = m.HandshakeReady(
            num_blocks=self.engine.num_blocks,
            block_size=cfg.cache.block_size,
            max_model_len=cfg.scheduler.max_model_len,
        )
        self.input_socket.send(self.encoder.encode(ready))
        threads = [(self._input_thread, "input"), (self._output_thread, "output")]
        if self.parent_pid is not None:
            threads.append((self._parent_watch_thread, "parent-watch"))
        for target, name in threads:
            t = threading.Thread(target=target, name=f"EngineCore-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return True

    # ---- IO threads -------------------------------------------------------------------------------

    def _input_thread(self) -> None:
        decoders = {m.RequestType.ADD.value: m.decoder(m.EngineCoreRequest),
                    m.RequestType.ABORT.value: m.decoder(list[str]),
                    m.RequestType.UTILITY.value: m.decoder(m.UtilityCall),
                    m.RequestType.START_WAVE.value: m.decoder(int)}
        sock = self.input_socket
        try:
            while not self.stop.is_set():
                if not sock.poll(int(POLL_S * 1000)):
                    continue
                kind, payload = sock.recv_multipart(copy=False)
                kind = bytes(kind.buffer)
                decoder = decoders.get(kind)
                if decoder is None:
                    logger.error("unknown request type %r; ignored", kind)
                    continue
                self.input_queue.put((kind, decoder.decode(payload.buffer)))
        except Exception as e:  # noqa: BLE001
            if not self.stop.is_set():
                logger.exception("input thread failed")
                self.input_queue.put((b"fatal", e))

    def _output_thread(self) -> None:
        sock = self.output_socket
        while True:
            item = self.output_queue.get()
            if item is _STOP:
                return
            try:
                if item is m.ENGINE_CORE_DEAD:
                    sock.send(m.ENGINE_CORE_DEAD)
                else:
                    sock.send(self.encoder.encode(item))
            except zmq.ZMQError:
                if not self.stop.is_set():
                    logger.exception("output thread failed")
                return

    def _orphaned(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def _parent_watch_thread(self) -> None:
        while not self.stop.wait(0.5):
            if self._orphaned():
                logger.error("the front-end process died; engine core exiting")
                self.stop.set()
                time.sleep(ORPHAN_GRACE_S)  # the busy loop normally exits within a step
                os._exit(1)

    # ---- busy loop --------------------------------------------------------------------------------

    def _step_fn(self):
        # async scheduling: launch step N+1 before collecting step N (EngineCore.step_with_batch_queue)
        engine = self.engine
        return engine.step_with_batch_queue if engine.config.async_scheduling else engine.step

    def run_busy_loop(self) -> None:
        engine = self.engine
        step = self._step_fn()
        while not self.stop.is_set():
            self._process_input_queue()
            if self.stop.is_set() or not engine.has_unfinished_requests():
                self._publish_counts_if_changed()
                continue
            self._publish_updates(step())

    def _publish(self, outputs: m.EngineCoreOutputs) -> None:
        """Send a message, stamped with this rank and its load."""
        outputs.engine_index = self.rank
        outputs.counts = self._published_counts = self._counts()
        outputs.timestamp = time.time()
        self.output_queue.put(outputs)

    def _publish_updates(self, updates) -> None:
        if updates:
            self._publish(m.EngineCoreOutputs(outputs=[m.output_from_update(u) for u in updates]))
        else:
            self._publish_counts_if_changed()

    def _publish_counts_if_changed(self) -> None:
        if self._counts() != self._published_counts:
            self._publish(m.EngineCoreOutputs())

    def _counts(self) -> m.RankCounts:
        scheduler = self.engine.scheduler
        return m.RankCounts(len(scheduler.waiting), len(scheduler.running), self.num_received)

    def _idle(self) -> bool:
        """Nothing to step: the busy loop blocks on its input queue."""
        return not self.engine.has_unfinished_requests()

    def _process_input_queue(self) -> None:
        if self._idle():
            while not self.stop.is_set():  # idle: block for the next message
                try:
                    self._handle(*self.input_queue.get(timeout=POLL_S))
                    break
                except queue.Empty:
                    continue
        while True:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle(*item)

    def _handle(self, kind: bytes, msg) -> None:
        if kind == m.RequestType.ADD.value:
            self.num_received += 1
            try:
                params = m.params_from_dict(msg.sampling_params)
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, params)
            except (ValueError, TypeError) as e:
                # the front end validates first; this is the core refusing what slipped through
                self._publish(m.EngineCoreOutputs(outputs=[m.EngineCoreOutput(
                    req_id=msg.request_id, new_token_ids=[], finished=True, finish_reason="abort",
                    error=str(e))]))
        elif kind == m.RequestType.ABORT.value:
            before = self.engine.scheduler.get_num_unfinished_requests()
            self.engine.abort_requests(msg)
            self.num_aborted += before - self.engine.scheduler.get_num_unfinished_requests()
        elif kind == m.RequestType.UTILITY.value:
            self._publish(m.EngineCoreOutputs(utility_output=self._call_utility(msg)))
        elif kind == b"fatal":  # the input thread died
            raise RuntimeError(f"engine core input thread failed: {msg}")
        else:
            raise RuntimeError(f"engine core got a {kind!r} message it does not handle")

    def _call_utility(self, call: m.UtilityCall) -> m.UtilityResult:
        try:
            known = self.utility_methods
            if call.method not in known:
                raise ValueError(f"unknown utility method {call.method!r}; known: {', '.join(known)}")
            result = getattr(self, f"_utility_{call.method}")(*call.args)
            return m.UtilityResult(call_id=call.call_id, result=result)
        except Exception as e:  # noqa: BLE001 - a failed call is reported, not fatal
            return m.UtilityResult(call_id=call.call_id, failure_message=f"{type(e).__name__}: {e}")

    def _utility_get_stats(self) -> dict:
        stats = self.engine.get_stats()
        stats = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(stats)
        stats["num_aborted_requests"] = self.num_aborted
        stats["num_requests_received"] = self.num_received
        stats["num_blocks"] = self.engine.num_blocks
        stats["num_steps"] = self.engine.num_steps
        stats["scheduler_host_time_s"] = self.engine.scheduler_host_time
        stats["num_precompiling"] = int(self.engine.precompiling())  # summed over ranks: ranks still compiling
        return stats

    def _utility_reset_prefix_cache(self) -> bool:
        return bool(self.engine.reset_prefix_cache())

    def _utility_num_unfinished_requests(self) -> int:
        return self.engine.scheduler.get_num_unfinished_requests()

    def _utility_precompiling(self) -> bool:
        return self.engine.precompiling()

    # ---- shutdown ---------------------------------------------------------------------------------

    def close(self, dead: bool) -> None:
        """Flush the output queue (ENGINE_CORE_DEAD first if dying), stop the threads, close sockets,
        and free the engine's Ray workers if it has any."""
        if self.engine is not None:
            try:
                self.engine.shutdown()
            except Exception:  # noqa: BLE001 - closing the sockets matters more
                logger.exception("engine shutdown failed")
        if dead and self.output_socket is not None:
            self.output_queue.put(m.ENGINE_CORE_DEAD)
        self.stop.set()
        self.output_queue.put(_STOP)
        for t in self._threads:
            if t.name.endswith("output"):
                t.join(timeout=2.0)
        for t in self._threads:
            if not t.name.endswith("output"):
                t.join(timeout=1.0)
        if any(t.is_alive() for t in self._threads):
            return  # a thread is stuck in a socket call: leave the sockets to os._exit
        for sock in (self.input_socket, self.output_socket):
            if sock is not None:
                sock.close(linger=1000 if dead else 0)
        self.ctx.term()


def make_engine_core_proc(input_address: str, parent_pid: int | None, rank: int,
                          coordinator_address: str | None) -> EngineCoreProc:
    """The core of one rank: one that steps in waves when it has a wave coordinator."""
    if coordinator_address is None:
        return EngineCoreProc(input_address, parent_pid, rank)
    from tokenmill.engine.dp_core_proc import DPWaveEngineCoreProc

    return DPWaveEngineCoreProc(input_address, parent_pid, rank, coordinator_address)


def serve_engine_core(proc: EngineCoreProc) -> int:
    """Handshake, then step until told to stop. Returns the exit code: 0 clean stop, 1 start-up
    failure or fatal error (or the front end gone)."""
    from tokenmill import envs

    dead = False
    try:
        if proc.handshake_and_start():
            envs.freeze()
            proc.run_busy_loop()
        else:
            dead = True
    except Exception:  # noqa: BLE001 - fatal: tell the front end, then exit non-zero
        logger.exception("engine core died of a fatal error")
        dead = True
    finally:
        proc.close(dead)
    return 1 if dead or proc._orphaned() else 0


def log_format(rank: int) -> str:
    return f"%(asctime)s %(levelname)s EngineCore[{os.getpid()}] rank {rank} %(name)s: %(message)s"


def run_engine_core(input_address: str, parent_pid: int, rank: int = 0, visible_devices: str | None = None,
                    coordinator_address: str | None = None) -> None:
    """The spawned process's entry point. Exit codes: those of serve_engine_core.

    `rank`: its data-parallel rank; `visible_devices`: its slice of the accelerators (dp_devices.py),
    or None to keep the inherited environment; `coordinator_address`: the wave coordinator's, for a
    rank that steps in waves (dp_core_proc.py).
    """
    from tokenmill import envs
    from tokenmill.engine.dp_devices import DEVICE_ENV

    if visible_devices is not None:  # before anything starts JAX's backends in this process
        os.environ[DEVICE_ENV] = visible_devices
    logging.basicConfig(level=envs.TOKENMILL_LOGGING_LEVEL, format=log_format(rank))
    # Its own process group: a terminal's Ctrl-C reaches the front end only, which drains its requests
    # and then stops the core with SIGTERM (the core still exits if the front end dies, see above).
    try:
        os.setpgrp()
    except OSError:
        pass
    proc = make_engine_core_proc(input_address, parent_pid, rank, coordinator_address)

    def _on_signal(signum, frame):  # stop between steps; the loop exits cleanly
        proc.stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    code = serve_engine_core(proc)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never hang on interpreter teardown (JAX, ZMQ) once the work is done
