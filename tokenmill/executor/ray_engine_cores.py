"""Data-parallel engine cores as Ray actors (data_parallel_backend="ray"), one per rank.

With the default "mp" backend the front end spawns each rank's engine core as a local process.
With "ray" each rank runs in a Ray actor instead, anywhere in the cluster: a placement group holds
one bundle of tensor_parallel_size devices (TOKENMILL_RAY_DEVICE_RESOURCE) per rank, packed onto as
few hosts as hold them, and the actor runs the same engine-core loop as a spawned process would
(core_proc.serve_engine_core), talking to the front end over ZMQ on TCP instead of IPC sockets.

`RayEngineCore` gives the front end (engine/client.py) the part of multiprocessing.Process's
interface it uses for a local core: start, pid, is_alive, exitcode, join, a sentinel to wait on,
terminate (a clean stop between steps) and kill. An actor dies with the driver that created it, so
a core on Ray needs no parent watch.
"""

from __future__ import annotations

import logging
import os
import threading

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tokenmill import envs
from tokenmill.executor import ray_cluster

logger = logging.getLogger(__name__)


class EngineCoreActor:
    """A Ray actor that runs one engine-core rank. Two calls may run at once (max_concurrency=2):
    `run`, which blocks while the core serves, and `stop`."""

    def __init__(self):
        self._proc = None
        self._stop_requested = threading.Event()

    def pid(self) -> int:
        return os.getpid()

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def run(self, input_address: str, rank: int, coordinator_address: str | None) -> int:
        """Serve until stopped; returns the core's exit code (core_proc.serve_engine_core)."""
        from tokenmill.engine import core_proc

        logging.basicConfig(level=envs.TOKENMILL_LOGGING_LEVEL, format=core_proc.log_format(rank))
        self._proc = core_proc.make_engine_core_proc(input_address, None, rank, coordinator_address)
        if self._stop_requested.is_set():
            self._proc.stop.set()
        return core_proc.serve_engine_core(self._proc)

    def stop(self) -> None:
        self._stop_requested.set()
        if self._proc is not None:
            self._proc.stop.set()


class RayEngineCore:
    """One rank's actor, behind the multiprocessing.Process interface that EngineCoreClient uses."""

    def __init__(self, actor, name: str, run_args: tuple):
        self.actor = actor
        self.name = name
        self.pid: int | None = None
        self.exitcode: int | None = None
        self.node_ip: str | None = None
        self._run_args = run_args
        self._watcher: threading.Thread | None = None
        # readable once the core has exited: what multiprocessing.connection.wait waits on
        self._exited_r, self._exited_w = os.pipe()

    def start(self) -> None:
        self.pid, self.node_ip = ray.get([self.actor.pid.remote(), self.actor.node_ip.remote()])
        ref = self.actor.run.remote(*self._run_args)
        self._watcher = threading.Thread(target=self._watch, args=(ref,), name=f"{self.name}-watch", daemon=True)
        self._watcher.start()

    def _watch(self, ref) -> None:
        try:
            self.exitcode = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - the actor died (killed, its node lost, ...)
            logger.debug("%s: %s", self.name, e)
            self.exitcode = -9
        os.write(self._exited_w, b"x")

    @property
    def sentinel(self) -> int:
        return self._exited_r

    def is_alive(self) -> bool:
        return self._watcher is not None and self._watcher.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self._watcher is not None:
            self._watcher.join(timeout)

    def terminate(self) -> None:
        self.actor.stop.remote()

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)

    def close(self) -> None:
        """Free the actor (after it has exited, or to end it)."""
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.join(5.0)
        for fd in (self._exited_r, self._exited_w):
            os.close(fd)


class RayEngineCores:
    """The actors of every rank and the placement group that holds their devices."""

    def __init__(self, num_ranks: int, devices_per_rank: int):
        resource = envs.TOKENMILL_RAY_DEVICE_RESOURCE
        ray_cluster.connect(resource, local_devices=num_ranks * devices_per_rank)
        self.group: PlacementGroup | None = placement_group(
            [{resource: float(devices_per_rank)} for _ in range(num_ranks)], strategy="PACK")
        timeout = envs.TOKENMILL_RAY_PLACEMENT_TIMEOUT_S
        ready, _ = ray.wait([self.group.ready()], timeout=timeout)
        if not ready:
            self.close()
            raise RuntimeError(
                f"Ray could not reserve {num_ranks} data-parallel rank(s) x {devices_per_rank} '{resource}' "
                f"within {timeout:g} s (TOKENMILL_RAY_PLACEMENT_TIMEOUT_S). {ray_cluster.cluster_summary(resource)}"
            )
        # Ray takes GPUs through num_gpus only (and then sets CUDA_VISIBLE_DEVICES in the actor)
        self._devices = ({"num_gpus": devices_per_rank} if resource == "GPU"
                         else {"resources": {resource: devices_per_rank}})
        self._actor_class = ray.remote(EngineCoreActor)
        self.cores: list[RayEngineCore] = []

    def core(self, rank: int, name: str, input_address: str, coordinator_address: str | None) -> RayEngineCore:
        actor = self._actor_class.options(
            num_cpus=0, max_concurrency=2, **self._devices,
            runtime_env={"env_vars": ray_cluster.worker_env()},
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank),
        ).remote()
        core = RayEngineCore(actor, name, (input_address, rank, coordinator_address))
        self.cores.append(core)
        return core

    def close(self) -> None:
        for core in self.cores:
            core.close()
        self.cores = []
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None
