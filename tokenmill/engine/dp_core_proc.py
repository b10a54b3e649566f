"""A data-parallel engine core that steps in lock-step waves with the other ranks (vLLM v1's DP scheme).

Ranks that serve one expert-parallel MoE model must all run each forward: the experts' collectives
need every rank. So while any rank has work, every rank steps: a rank with requests runs a real
step, an idle one a dummy batch (EngineCore.execute_dummy_batch). A wave is such a run of steps:

    idle ──(START_WAVE w from the front end, or a request arrives)──▶ running wave w
    running: one forward per step; every WAVE_SYNC_STEPS steps, the all-reduce "any work left?"
             (dp_coordinator.py): yes → go on; no → publish wave_complete=w, wave = w + 1, idle

An idle rank blocks on its input queue (no busy spin). A request that reaches a rank after its wave
ended (the front end had not heard yet) starts the next wave on that rank, which asks the front end
(start_wave) to start it on every rank. Every rank starts a wave at step 0 and gets the same answer
at each sync point, so all ranks end a wave at the same step.
"""

from __future__ import annotations

import logging

from tokenmill import envs
from tokenmill.engine import messages as m
from tokenmill.engine.core_proc import EngineCoreProc
from tokenmill.engine.dp_coordinator import WAVE_SYNC_STEPS, WaveSyncClient

logger = logging.getLogger("tokenmill.engine_core")


class DPWaveEngineCoreProc(EngineCoreProc):
    utility_methods = EngineCoreProc.utility_methods + ("get_wave_state",)

    def __init__(self, input_address: str, parent_pid: int, rank: int, coordinator_address: str):
        super().__init__(input_address, parent_pid, rank)
        # a peer that waits this long for the others is as stuck as a core that produces nothing
        self.sync = WaveSyncClient(self.ctx, coordinator_address, rank, envs.TOKENMILL_ENGINE_STALL_TIMEOUT_S)
        self.wave = 0  # the wave running, or the next one to run
        self.running = False
        self.wave_step = 0  # steps of the current wave
        self.num_real_steps = 0
        self.num_dummy_steps = 0

    def _idle(self) -> bool:
        return not self.running

    def run_busy_loop(self) -> None:
        engine = self.engine
        step = self._step_fn()
        while not self.stop.is_set():
            self._process_input_queue()
            if self.stop.is_set():
                return
            if not self.running:
                self._publish_counts_if_changed()
                continue
            forwards = engine.num_forward_steps
            if engine.has_unfinished_requests():
                self._publish_updates(step())
            if engine.num_forward_steps > forwards:
                self.num_real_steps += 1
            else:  # nothing of its own to run this step (or only collecting the last one)
                engine.execute_dummy_batch()
                self.num_dummy_steps += 1
            self.wave_step += 1
            if self.wave_step % WAVE_SYNC_STEPS == 0:
                sync_point = self.wave_step // WAVE_SYNC_STEPS
                any_work = self.sync.any_work(self.wave, sync_point, engine.has_unfinished_requests(), self.stop)
                if any_work is None:  # told to stop while waiting for the others
                    return
                if not any_work:
                    self._end_wave()

    def _start_wave(self, wave: int) -> None:
        self.wave, self.running, self.wave_step = wave, True, 0
        logger.debug("rank %d: wave %d starts", self.rank, wave)

    def _end_wave(self) -> None:
        logger.debug("rank %d: wave %d complete after %d steps", self.rank, self.wave, self.wave_step)
        self._publish(m.EngineCoreOutputs(wave_complete=self.wave))
        self.wave, self.running, self.wave_step = self.wave + 1, False, 0

    def _handle(self, kind: bytes, msg) -> None:
        if kind == m.RequestType.START_WAVE.value:
            if not self.running and msg >= self.wave:  # else: a duplicate, or a wave already over
                self._start_wave(msg)
            return
        super()._handle(kind, msg)
        if kind == m.RequestType.ADD.value and not self.running and self.engine.has_unfinished_requests():
            # the front end sent it before it heard that the wave ended: start the next one everywhere
            self._start_wave(self.wave)
            self._publish(m.EngineCoreOutputs(start_wave=self.wave))

    def _utility_get_wave_state(self) -> dict:
        return {"rank": self.rank, "wave": self.wave, "running": self.running,
                "num_real_steps": self.num_real_steps, "num_dummy_steps": self.num_dummy_steps}

    def close(self, dead: bool) -> None:
        self.sync.close()  # the context cannot terminate with a socket open
        super().close(dead)
