"""One host's worker of a multi-host engine: a Ray actor created by tokenmill/executor/ray.py.

Every worker loads the same model, places it on one global mesh over all hosts' devices (JAX's
distributed runtime joins the processes) and runs the identical SPMD step on the same
SchedulerOutput; XLA's collectives cross the hosts. Being SPMD, every rank computes the same
ModelRunnerOutput, so only rank 0 sends its own back.

The executor calls, in order: node_info, set_visible_devices, free_port (rank 0),
init_distributed, describe, load_model, start_runner, precompile; then per step execute_model,
or launch_step / finish_step for async scheduling.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import jax
import ray

from tokenmill.config import EngineConfig
from tokenmill.core.step_io import ModelRunnerOutput, SchedulerOutput
from tokenmill.distributed.mesh import make_mesh
from tokenmill.engine.core import determine_num_blocks, prepare_model
from tokenmill.model.loader import LoadedModel
from tokenmill.worker.compilation_cache import enable_compilation_cache
from tokenmill.worker.model_runner import ModelRunner, StepInFlight

# how a Ray accelerator resource's device ids reach the process that uses them
VISIBLE_DEVICES_ENV = {"GPU": "CUDA_VISIBLE_DEVICES"}


@dataclass(frozen=True)
class NodeInfo:
    ip: str
    node_id: str
    device_ids: tuple[str, ...]  # accelerator ids Ray assigned (empty for a custom resource)


def host_major_devices(devices_per_host: int) -> list[jax.Device]:
    """The mesh's devices: the first `devices_per_host` of each process, in process (rank) order, so
    that every host holds its share of the "model" axis even if it has more devices than it offers."""
    by_process: dict[int, list[jax.Device]] = {}
    for device in jax.devices():
        by_process.setdefault(device.process_index, []).append(device)
    devices = []
    for process in sorted(by_process):
        local = sorted(by_process[process], key=lambda d: d.id)
        if len(local) < devices_per_host:
            raise RuntimeError(
                f"process {process} has {len(local)} {local[0].platform.upper()} device(s), but each host "
                f"must bring {devices_per_host} (its Ray device resource says so)"
            )
        devices += local[:devices_per_host]
    return devices


class HostWorker:
    def __init__(self):
        self.rank: int | None = None
        self.mesh = None
        self.runner: ModelRunner | None = None
        self._config: EngineConfig | None = None
        self._model: LoadedModel | None = None  # loaded, until the runner has placed it on devices
        self._launched: dict[int, StepInFlight] = {}  # step id → launched step (async scheduling)

    # ---- start-up ----------------------------------------------------------------------------

    def node_info(self, device_resource: str) -> NodeInfo:
        context = ray.get_runtime_context()
        ids = context.get_accelerator_ids().get(device_resource, [])
        return NodeInfo(ray.util.get_node_ip_address(), context.get_node_id(), tuple(ids))

    def set_visible_devices(self, device_resource: str, device_ids: list[str]) -> None:
        """Hand this host's device ids to the runtime; read when JAX's backend starts, so before
        init_distributed. A custom resource (CPU hosts) has no ids and nothing to hand over."""
        env = VISIBLE_DEVICES_ENV.get(device_resource)
        if env is not None and device_ids:
            os.environ[env] = ",".join(device_ids)

    def free_port(self) -> int:
        """A port free on this host now, for JAX's coordinator (rank 0 hosts it)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def init_distributed(self, coordinator_address: str, num_processes: int, rank: int, timeout_s: int) -> None:
        # CPU collectives across processes go through gloo; the setting is inert on GPU and TPU
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=rank,
                                   initialization_timeout=timeout_s)
        self.rank = rank

    def describe(self) -> dict:
        """Where this worker stands in the JAX job (checked by the executor at start-up)."""
        return dict(rank=self.rank, ip=ray.util.get_node_ip_address(), pid=os.getpid(),
                    process_index=jax.process_index(), process_count=jax.process_count(),
                    device_count=jax.device_count(), local_device_count=jax.local_device_count(),
                    platform=jax.devices()[0].platform)

    def load_model(self, config: EngineConfig, model: LoadedModel | None, devices_per_host: int) -> int:
        """Load (or take the shipped) model and build the global mesh; returns how many KV blocks
        this host's memory budget holds."""
        enable_compilation_cache()
        self._config = config
        self._model = prepare_model(config, model)
        self.mesh = make_mesh(config.parallel.tensor_parallel_size, host_major_devices(devices_per_host))
        return determine_num_blocks(config, self._model)

    def start_runner(self, num_blocks: int) -> None:
        config = self._config
        # every rank places the same host arrays on the global shardings: each keeps its own shards
        self.runner = ModelRunner(self._model, config.scheduler, config.cache, num_blocks, config.dtype, mesh=self.mesh)
        self._model = None  # the runner holds the weights on device now

    def precompile(self) -> None:
        self.runner.precompile()

    # ---- steps -------------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self._rank0_only(self.runner.execute_model(scheduler_output))

    def execute_dummy_batch(self) -> None:
        self.runner.execute_dummy_batch()

    def launch_step(self, step_id: int, scheduler_output: SchedulerOutput) -> None:
        self._launched[step_id] = self.runner.launch(scheduler_output)

    def finish_step(self, step_id: int) -> ModelRunnerOutput | None:
        return self._rank0_only(self.runner.finish(self._launched.pop(step_id)))

    def _rank0_only(self, output: ModelRunnerOutput) -> ModelRunnerOutput | None:
        # SPMD: the other ranks computed the same output; sending it would only cost serialization
        return output if self.rank == 0 else None
