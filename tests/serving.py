"""Test helper: a real `tokenmill serve` in a subprocess on loopback (not a test module itself)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

# Small settings keep compile time down (every shape compiles on first use).
SMALL_ENGINE_ARGS = ["--max-model-len", "512", "--max-num-seqs", "16", "--max-num-batched-tokens", "256"]
_READY = re.compile(r"tokenmill: serving (\S+) on (http://\S+)")


def _tokenmill_cmd() -> list[str]:
    script = Path(sys.executable).parent / "tokenmill"
    return [str(script)] if script.exists() else [sys.executable, "-m", "tokenmill.cli.main"]


class ServerProcess:
    """`tokenmill serve ARGS` in its own session; stdout lines are collected, stderr goes to a file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        full_env = dict(os.environ)
        full_env.setdefault("TOKENMILL_SKIP_PRECOMPILE", "1")
        full_env.update(env or {})
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            _tokenmill_cmd() + ["serve", *args], stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=full_env, start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stdout: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url: str | None = None
        self.model: str | None = None

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.stdout.append(line)
            self.lines.put(line)

    def wait_ready(self, timeout: float = 240.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
                continue
            match = _READY.search(line)
            if match:
                self.model, self.url = match.group(1), match.group(2)
                return self
        raise AssertionError(f"server not ready after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def core_pid(self) -> int:
        """The engine-core process: the server's spawned child (not the resource tracker)."""
        pid = self.proc.pid
        for _ in range(50):
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            for child in children:
                try:
                    cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
                except FileNotFoundError:
                    continue
                if b"spawn_main" in cmdline:
                    return int(child)
            time.sleep(0.1)
        raise AssertionError("no engine-core child process found")

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the session (the engine core included)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=10)
        self._log.close()


def metrics(url: str, headers: dict | None = None) -> dict[str, float]:
    """/metrics as {name: value}, labels dropped (one model per server) except finished_reason."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        reason = re.search(r'finished_reason="(\w+)"', name)
        base = name.split("{", 1)[0]
        out[f"{base}:{reason.group(1)}" if reason else base] = float(value)
    return out


async def drain_until_dead(gen):
    """Consume a generate() stream; the EngineDeadError it ends with, or None if it finished."""
    from tokenmill.engine.async_llm import EngineDeadError

    try:
        async for _ in gen:
            pass
    except EngineDeadError as e:
        return e
    return None


def wait_for(predicate, timeout: float, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def run_failing_engine_core(*args) -> None:
    """An engine-core entry point (run_engine_core's arguments) whose first step raises (imported by
    the spawned child)."""
    from tokenmill.engine import core

    def boom(self):
        raise RuntimeError("injected failure")

    core.EngineCore.step = core.EngineCore.step_with_batch_queue = boom
    from tokenmill.engine.core_proc import run_engine_core

    run_engine_core(*args)
