"""EngineCore: schedule → execute → update. No I/O in here; the process wrapper adds the sockets."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
import weakref

import jax

from tokenmill.config import EngineConfig
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.distributed.mesh import check_model_fits, make_mesh
from tokenmill.executor import distributed_executor_backend
from tokenmill.model.loader import LoadedModel, load_config, load_model
from tokenmill.model.quantize import (
    KEEP_GGUF_BLOCKS, KEEP_GGUF_BLOCKS_INT, quantize_experts, quantize_linear_layers,
)
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.compilation_cache import enable_compilation_cache
from tokenmill.worker.memory import free_device_memory
from tokenmill.worker.model_runner import ModelRunner, kv_block_bytes, kv_cache_dtype

logger = logging.getLogger(__name__)


def determine_num_blocks(config: EngineConfig, model: LoadedModel) -> int:
    """KV blocks from the memory budget: `kv_cache_memory` bytes, or a fraction of free memory.

    Never more than max_num_seqs requests at max_model_len could use at once (plus the null block).
    On CPU the data-parallel ranks share the host's memory: each takes its share of the fraction.
    """
    cache, sched = config.cache, config.scheduler
    if cache.num_blocks is not None:
        return cache.num_blocks
    block_bytes = kv_block_bytes(model, cache.block_size, kv_cache_dtype(cache.kv_cache_dtype, config.dtype))
    budget = cache.kv_cache_memory
    if budget is None:
        budget = int(free_device_memory() * cache.kv_cache_memory_fraction)
        if jax.default_backend() == "cpu":
            budget //= config.parallel.data_parallel_size
    blocks_per_seq = -(-sched.max_model_len // cache.block_size)
    num_blocks = min(budget // block_bytes, sched.max_num_seqs * blocks_per_seq + 1)
    if num_blocks < blocks_per_seq + 1:
        raise ValueError(
            f"KV cache budget of {budget / 2**20:.1f} MiB holds {num_blocks} blocks of {cache.block_size} tokens, "
            f"fewer than one request at max_model_len={sched.max_model_len} needs ({blocks_per_seq + 1}); "
            "raise --kv-cache-memory or lower --max-model-len"
        )
    return int(num_blocks)


def prepare_model(config: EngineConfig, model: LoadedModel | None, tokenizer: bool = True) -> LoadedModel:
    """The model to run: `model`, else the checkpoint at config.model (with its tokenizer if asked);
    experts quantized if asked. Runs where the weights are placed: in the engine, or in each host's
    worker (worker/worker.py)."""
    if model is None:
        model = load_model(config.model, tokenizer=tokenizer,
                           keep_gguf_blocks=config.quantization in (KEEP_GGUF_BLOCKS, KEEP_GGUF_BLOCKS_INT))
        if config.quantization == KEEP_GGUF_BLOCKS_INT and model.config.quantization == KEEP_GGUF_BLOCKS:
            model = dataclasses.replace(model, config=dataclasses.replace(model.config, quantization=KEEP_GGUF_BLOCKS_INT))
    if config.expert_quantization and not model.config.expert_quantization:
        model = quantize_experts(model, config.expert_quantization, config.expert_quantization_window)
        logger.info("experts quantized at load time to %s, one scale per %d rows",
                    config.expert_quantization, config.expert_quantization_window)
    if config.quantization and not model.config.quantization:
        model = quantize_linear_layers(model, config.quantization)
        window = model.config.quant_window
        logger.info("projections and LM head quantized at load time to %s, one scale per %s",
                    config.quantization, f"{window} rows" if window else "column")
    return model


class EngineCore:
    def __init__(self, config: EngineConfig, model: LoadedModel | None = None, enable_prefix_caching: bool = True,
                 tokenizer: bool = True):
        """`tokenizer`: whether the model loaded here (model=None) needs its tokenizer; an engine core
        process behind AsyncLLM does not (its front end tokenizes and detokenizes)."""
        enable_compilation_cache()
        self.config = config
        self._release_workers = None
        parallel = config.parallel
        on_ray = distributed_executor_backend(parallel) == "ray"
        # refuse impossible parallel sizes before minutes of loading (on Ray the workers make the mesh)
        mesh = None if on_ray else make_mesh(parallel.tensor_parallel_size)
        check_model_fits(model.config if model is not None else load_config(config.model),
                         parallel.tensor_parallel_size, parallel.enable_expert_parallel)
        if on_ray:
            from tokenmill.executor.ray import RayExecutor  # Ray is an optional dependency

            # one worker per host loads, shards and steps the model; this process only schedules.
            # The executor steps like a ModelRunner: execute_model, launch / finish.
            self.runner = RayExecutor(config, model)
            # an engine dropped without shutdown() still frees the workers when it is collected
            self._release_workers = weakref.finalize(self, self.runner.shutdown)
            self.model, num_blocks = self.runner.model, self.runner.num_blocks
        else:
            self.model = prepare_model(config, model, tokenizer)
            num_blocks = determine_num_blocks(config, self.model)
        cfg = self.model.config
        sched = config.scheduler
        if sched.max_model_len > cfg.max_position_embeddings:
            logger.warning(
                "max_model_len %d exceeds the model's max_position_embeddings %d",
                sched.max_model_len, cfg.max_position_embeddings,
            )
        block_size = config.cache.block_size
        logger.info(
            "KV cache: %d blocks = %d tokens of %s; max concurrency %.1fx at max_model_len %d",
            num_blocks, num_blocks * block_size, kv_cache_dtype(config.cache.kv_cache_dtype, config.dtype).name,
            (num_blocks - 1) * block_size / sched.max_model_len, sched.max_model_len,
        )
        if not on_ray:  # the Ray workers have built and compiled theirs
            self.runner = ModelRunner(self.model, sched, config.cache, num_blocks, config.dtype, mesh=mesh)
            self.runner.precompile(background=True)  # the engine serves while the other shapes compile
        self.scheduler = Scheduler(sched, config.cache, num_blocks, enable_prefix_caching=enable_prefix_caching,
                                   speculative_config=config.speculative_config)
        if config.speculative_config is not None:
            logger.info("speculative decoding: %s", config.speculative_config)
        self._rng = random.Random(config.seed)
        self.num_blocks = num_blocks
        self._in_flight = None  # (SchedulerOutput, StepInFlight) of step_with_batch_queue
        # the scheduler's own host time (schedule + update_from_output), for the benchmarks
        self.scheduler_host_time = 0.0
        self.num_steps = 0
        self.num_forward_steps = 0  # steps that ran the model on scheduled tokens

    def shutdown(self) -> None:
        """Release what the engine holds outside this process (the Ray workers and their devices),
        stop precompiling; safe to call more than once."""
        if self._release_workers is not None:
            self._release_workers()
        else:
            self.runner.shutdown()

    def wait_precompiled(self) -> None:
        """Block until every shape bucket is compiled."""
        self.runner.wait_precompiled()

    def precompiling(self) -> bool:
        """Whether shape buckets are still compiling in the background."""
        return self.runner.precompiling()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; raises ValueError if it can never fit."""
        seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        eos = () if params.ignore_eos else self.model.config.eos_token_ids
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=tuple(eos),
            arrival_time=time.time(),
            seed=seed,
        )
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids) -> None:
        self.scheduler.finish_requests(list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self):
        """One engine step; returns the per-request updates it produced."""
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self._schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        return self._update(scheduler_output, runner_output)

    def step_with_batch_queue(self):
        """Async scheduling: schedule and launch step N+1, then collect step N, so the host work of
        one step overlaps the device work of the other. Outputs equal `step()`'s: a request whose
        token is still in flight decodes at that position, fed from the device.

        Requests with penalties, and speculative decoding (proposals come from a request's latest
        tokens), need the full output history on the host, so while a request with penalties runs,
        or with speculative decoding on, the engine falls back to one step at a time.
        """
        updates = []
        if self._in_flight is not None and (
            self.scheduler.speculative is not None
            or any(r.sampling_params.uses_penalties for r in self.scheduler.running)
        ):
            updates += self._collect()
        handle = None
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self._schedule()
            if scheduler_output.num_scheduled_tokens or scheduler_output.finished_req_ids:
                handle = (scheduler_output, self.runner.launch(scheduler_output))
        updates += self._collect()
        self._in_flight = handle
        return updates

    def _collect(self):
        if self._in_flight is None:
            return []
        scheduler_output, launched = self._in_flight
        self._in_flight = None
        return self._update(scheduler_output, self.runner.finish(launched))

    def _schedule(self):
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        self.scheduler_host_time += time.perf_counter() - start
        self.num_steps += 1
        if scheduler_output.num_scheduled_tokens:  # both step functions run the model on these
            self.num_forward_steps += 1
        return scheduler_output

    def _update(self, scheduler_output, runner_output):
        start = time.perf_counter()
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.scheduler_host_time += time.perf_counter() - start
        return updates

    def execute_dummy_batch(self) -> None:
        """What an idle data-parallel rank runs so that the ranks of one expert-parallel model step
        together (see ModelRunner.execute_dummy_batch)."""
        self.runner.execute_dummy_batch()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def get_stats(self) -> dict:
        return self.scheduler.get_stats()
