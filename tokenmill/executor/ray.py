"""The Ray executor: one worker actor per host, all running the same SPMD step on one global mesh.

The engine core (the driver) schedules; every step it sends the SchedulerOutput to every worker
and takes rank 0's ModelRunnerOutput. It steps like a ModelRunner (execute_model, and launch /
finish for async scheduling), so EngineCore drives either the same way.

Start-up: join the cluster (ray_cluster.py), reserve one bundle of devices per host, start a
worker in each (the driver's TOKENMILL_*, JAX_* and XLA_FLAGS with it), rank them driver's node
first, hand each its node's device ids, then initialise JAX's distributed runtime across them
(coordinator: rank 0's host) and load, shard and compile the model on every worker.

No hang: every wait on a worker has a timeout, and a worker that dies or fails takes the executor
down with a RuntimeError naming it (Ray's error chained), so the engine fails its requests.
Workers load the checkpoint from their own disk: the model path must exist on every host (a model
given already loaded is shipped through Ray's object store instead).
"""

from __future__ import annotations

import itertools
import logging

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tokenmill import envs
from tokenmill.config import EngineConfig
from tokenmill.core.step_io import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor import ray_cluster
from tokenmill.model.loader import LoadedModel, default_model_path, load_config, load_tokenizer
from tokenmill.worker.worker import HostWorker, NodeInfo

logger = logging.getLogger(__name__)


def _driver_model(config: EngineConfig) -> LoadedModel:
    """What the engine itself needs of the model: config and tokenizer. The weights stay on the workers."""
    path = config.model if config.model is not None else default_model_path()
    tokenizer, chat_template = load_tokenizer(path)
    return LoadedModel(load_config(path), {}, tokenizer, chat_template, source=path)


class RayExecutor:
    def __init__(self, config: EngineConfig, model: LoadedModel | None = None):
        config = config.with_absolute_model_path()  # the workers do not share our working directory
        tp = config.parallel.tensor_parallel_size
        resource = envs.TOKENMILL_RAY_DEVICE_RESOURCE
        startup_timeout = envs.TOKENMILL_ENGINE_STARTUP_TIMEOUT_S
        self.step_timeout = envs.TOKENMILL_RAY_STEP_TIMEOUT_S
        self.model = model if model is not None else _driver_model(config)
        self.workers: list = []  # actor handles, in rank order
        self.placement: list[NodeInfo] = []  # each rank's node
        self._group = None
        self._failure: str | None = None
        self._step_ids = itertools.count()

        ray_cluster.connect(resource, local_devices=tp)
        plan = ray_cluster.plan_hosts(tp, resource)
        self._group = ray_cluster.reserve_hosts(plan, envs.TOKENMILL_RAY_PLACEMENT_TIMEOUT_S)
        try:
            self._start_workers(plan)
            self._init_jax(plan, startup_timeout)
            model_ref = ray.put(model) if model is not None else None
            per_host_blocks = self.collective_rpc("load_model", config, model_ref, plan.devices_per_host,
                                                  timeout=startup_timeout)
            # every host holds the same share of the cache: the smallest budget decides
            self.num_blocks = min(per_host_blocks)
            self.collective_rpc("start_runner", self.num_blocks, timeout=startup_timeout)
            self.collective_rpc("precompile", timeout=startup_timeout)
        except BaseException:
            self.shutdown()
            raise

    # ---- start-up ----------------------------------------------------------------------------

    def _start_workers(self, plan: ray_cluster.HostPlan) -> None:
        resource = plan.device_resource
        # Ray takes GPUs through num_gpus only; any other device resource is a custom one
        devices = ({"num_gpus": plan.devices_per_host} if resource == "GPU"
                   else {"resources": {resource: plan.devices_per_host}})
        actor = ray.remote(HostWorker)
        # the environment is set as each worker process starts: JAX reads JAX_* when it is imported
        runtime_env = {"env_vars": ray_cluster.worker_env()}
        workers = [
            actor.options(num_cpus=0, **devices, runtime_env=runtime_env, scheduling_strategy=
                          PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=i)).remote()
            for i in range(plan.num_hosts)
        ]
        self.workers = workers  # bundle order until ranked, so that a failure below names them
        infos = self._gather([w.node_info.remote(resource) for w in workers], "node_info",
                             envs.TOKENMILL_ENGINE_STARTUP_TIMEOUT_S)
        order = ray_cluster.rank_order(infos, plan.driver.node_id)
        self.workers = [workers[i] for i in order]
        self.placement = [infos[i] for i in order]
        device_ids = ray_cluster.node_device_ids(self.placement)
        self._gather([w.set_visible_devices.remote(resource, device_ids[info.node_id])
                      for w, info in zip(self.workers, self.placement)], "set_visible_devices", self.step_timeout)
        logger.info("ray: %d worker(s), by rank: %s", len(self.workers),
                    ", ".join(f"{r}: {info.ip}" for r, info in enumerate(self.placement)))

    def _init_jax(self, plan: ray_cluster.HostPlan, timeout: float) -> None:
        port = self._gather([self.workers[0].free_port.remote()], "free_port", self.step_timeout)[0]
        coordinator = f"{self.placement[0].ip}:{port}"
        n = len(self.workers)
        self._gather([w.init_distributed.remote(coordinator, n, rank, int(timeout))
                      for rank, w in enumerate(self.workers)], "init_distributed", timeout)
        for rank, info in enumerate(self.collective_rpc("describe")):
            joined = (info["process_index"], info["process_count"]) == (rank, n)
            if not joined or info["local_device_count"] < plan.devices_per_host:
                raise RuntimeError(f"worker rank {rank} joined the JAX job wrongly: {info} (expected "
                                   f"process {rank} of {n} with {plan.devices_per_host} local device(s))")
        logger.info("ray: JAX initialised over %d processes (coordinator %s)", n, coordinator)

    # ---- calls on the workers ----------------------------------------------------------------

    def collective_rpc(self, method: str, *args, timeout: float | None = None):
        """Call `method(*args)` on every worker; their results, in rank order."""
        self._check_alive()
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        return self._gather(refs, method, self.step_timeout if timeout is None else timeout)

    def _gather(self, refs: list, what: str, timeout: float) -> list:
        """Results of one call per worker (refs in worker order). Ray raises as soon as one fails;
        a worker failure or a timeout takes the executor down, naming the worker."""
        try:
            return ray.get(refs, timeout=timeout)
        except GetTimeoutError:
            late = [r for r, ref in enumerate(refs) if not ray.wait([ref], timeout=0)[0]]
            raise self._fail(f"worker rank(s) {late} did not finish {what} within {timeout:g} s "
                             f"(TOKENMILL_RAY_STEP_TIMEOUT_S / TOKENMILL_ENGINE_STARTUP_TIMEOUT_S)") from None
        except RayError as e:
            rank = self._failed_rank(refs)
            where = f"worker rank {rank} on {self._ip(rank)}" if rank is not None else "a worker"
            verb = "died" if isinstance(e, RayActorError) else "failed"
            raise self._fail(f"{where} {verb} during {what}: {type(e).__name__}: {e}") from e

    def _failed_rank(self, refs: list) -> int | None:
        for rank, ref in enumerate(refs):
            if ray.wait([ref], timeout=0)[0]:
                try:
                    ray.get(ref, timeout=0)
                except RayError:
                    return rank
        return None

    def _ip(self, rank: int) -> str:
        return self.placement[rank].ip if rank < len(self.placement) else "an unplaced node"

    def _fail(self, message: str) -> RuntimeError:
        # the survivors may wait forever in a collective with the lost one: stop them all
        self._failure = f"Ray executor: {message}"
        logger.error(self._failure)
        self.shutdown()
        return RuntimeError(self._failure)

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise RuntimeError(self._failure)
        if not self.workers:
            raise RuntimeError("Ray executor: shut down")

    # ---- steps (ModelRunner's interface) -----------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", scheduler_output)[0]

    def execute_dummy_batch(self) -> None:
        self.collective_rpc("execute_dummy_batch")

    def launch(self, scheduler_output: SchedulerOutput) -> tuple[int, list]:
        """Dispatch a step on every worker without waiting; the handle for finish()."""
        self._check_alive()
        step_id = next(self._step_ids)
        return step_id, [w.launch_step.remote(step_id, scheduler_output) for w in self.workers]

    def finish(self, handle: tuple[int, list]) -> ModelRunnerOutput:
        step_id, launched = handle
        self._check_alive()
        finished = [w.finish_step.remote(step_id) for w in self.workers]
        # a failed launch fails its finish too (no such step): report the launch's own error first
        self._gather(launched, "launch_step", self.step_timeout)
        return self._gather(finished, "finish_step", self.step_timeout)[0]

    def wait_precompiled(self) -> None:
        """Nothing to wait for: the workers compiled every bucket before the executor was ready."""

    def precompiling(self) -> bool:
        return False

    def shutdown(self) -> None:
        """Stop the workers and free their devices; safe to call more than once."""
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers = []
        if self._group is not None:
            ray.util.remove_placement_group(self._group)
            self._group = None
