"""AsyncLLM: the serving front end. One async iterator of RequestOutput deltas per request.

    engine = AsyncLLM.from_engine_args(model, max_model_len=..., ...)   # spawns the engine core
    async for out in engine.generate(prompt, SamplingParams(...), request_id="r1"):
        print(out.outputs[0].text, end="")

Tokenization, validation, detokenization and stop strings happen here; the engine core (its own
process, see core_proc.py) only schedules and steps. Leaving the iterator early (the consumer is
cancelled or closes it) aborts the request in the core. If the core dies, every in-flight request
fails at once with EngineDeadError. Every wait has a timeout: a core that produces nothing for
TOKENMILL_ENGINE_STALL_TIMEOUT_S while requests are in flight is declared dead.

With data_parallel_size = N there are N engine cores (client.py): the samples of one request (n > 1)
go to one rank, so that they share its cached prompt blocks, and stats are merged over the ranks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

from tokenmill import envs
from tokenmill.config import EngineConfig, engine_config_from_kwargs
from tokenmill.engine import messages as m
from tokenmill.engine.client import EngineCoreClient, EngineDeadError, EngineStartupError
from tokenmill.engine.dp_coordinator import uses_waves
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.processor import Processor, PromptType
from tokenmill.model.loader import LoadedModel, default_model_path, load_config, load_tokenizer
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "EngineStartupError", "ProcessedPrompt", "RequestStats"]

_WAIT_S = 1.0  # a request's wait for its next output wakes up this often to check on the engine


@dataclass
class ProcessedPrompt:
    """A prompt tokenized and validated against its sampling parameters (safe to send to the core)."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams


@dataclass
class RequestStats:
    """One request's timings (time.monotonic) and token counts, for the metrics."""

    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"


class StatLogger(Protocol):
    def record_request(self, stats: RequestStats) -> None: ...


@dataclass
class _Stream:
    """A request in flight: its queue of outputs (or an exception) and its children (n > 1)."""

    request_id: str
    children: list[str]
    stats: RequestStats
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    unfinished: set[str] = field(default_factory=set)
    reasons: list[str] = field(default_factory=list)


class AsyncLLM:
    def __init__(self, config: EngineConfig, enable_prefix_caching: bool = True,
                 stat_logger: StatLogger | None = None, wave_mode: bool | None = None):
        """`wave_mode`: data-parallel ranks step in lock-step waves (dp_core_proc.py); None: when they
        serve an expert-parallel MoE model (dp_coordinator.uses_waves)."""
        # the config first: a bad model path fails here, at once, before any process starts
        model_config = load_config(config.model)
        # the core process needs no tokenizer: it starts while this one loads (about a second)
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
            tokenizer_loaded = pool.submit(load_tokenizer, config.model)
            if wave_mode is None:
                wave_mode = uses_waves(config.parallel, model_config)
            self.client = EngineCoreClient(config, enable_prefix_caching,
                                           startup_timeout_s=envs.TOKENMILL_ENGINE_STARTUP_TIMEOUT_S,
                                           wave_mode=wave_mode)
            try:
                tokenizer, chat_template = tokenizer_loaded.result()
            except BaseException:
                self.client.shutdown()
                raise
        self.config = config
        self.max_model_len = config.scheduler.max_model_len
        self.model = LoadedModel(config=model_config, params={}, tokenizer=tokenizer,
                                 chat_template=chat_template, source=config.model or default_model_path())
        self.tokenizer = tokenizer
        self.processor = Processor(self.model, self.max_model_len)
        self.output_processor = OutputProcessor(tokenizer)
        self.stat_logger = stat_logger
        self.num_blocks = self.client.num_blocks
        self.block_size = self.client.block_size
        self.stall_timeout_s = envs.TOKENMILL_ENGINE_STALL_TIMEOUT_S
        self._streams: dict[str, _Stream] = {}
        self._parent_of: dict[str, str] = {}
        self._started = False
        self._watchdog: asyncio.Task | None = None
        self._last_progress = time.monotonic()
        self.dead_reason: str | None = None
        self.dead_listeners: list[Callable[[str], None]] = []

    @classmethod
    def from_engine_args(cls, model: str | None = None, stat_logger: StatLogger | None = None,
                         wave_mode: bool | None = None, **kwargs) -> AsyncLLM:
        config, prefix_caching = engine_config_from_kwargs(model, **kwargs)
        return cls(config, prefix_caching, stat_logger=stat_logger, wave_mode=wave_mode)

    @property
    def errored(self) -> bool:
        return self.dead_reason is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def _ensure_started(self) -> None:
        if not self._started:
            self._started = True
            self.client.start(asyncio.get_running_loop(), self._on_outputs, self._on_dead)
            self._watchdog = asyncio.get_running_loop().create_task(self._watch_stalls())

    # ---- inputs -------------------------------------------------------------------------------------

    def process_inputs(self, prompt: PromptType | ProcessedPrompt, params: SamplingParams) -> ProcessedPrompt:
        """Tokenize and validate; raises ValueError (a bad request never reaches the core)."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        text, ids = self.processor.tokenize(prompt)
        self.processor.validate(ids, params)
        vocab = self.model.config.vocab_size
        for name, tokens in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in tokens if t >= vocab]
            if bad:
                raise ValueError(f"{name} has token id {bad[0]}, out of vocabulary (size {vocab})")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        blocks = -(-(len(ids) + max_tokens - 1) // self.block_size)
        if blocks > self.num_blocks - 1:
            raise ValueError(
                f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) needs {blocks} KV blocks; "
                f"the whole cache holds {self.num_blocks - 1}"
            )
        return ProcessedPrompt(text, ids, params)

    def process_chat(self, messages: list[dict], params: SamplingParams, add_generation_prompt: bool = True,
                     chat_template: str | None = None) -> ProcessedPrompt:
        text = self.processor.render_chat(messages, add_generation_prompt, chat_template)
        ids = self.processor.tokenize_chat(text)
        return self.process_inputs({"prompt": text, "prompt_token_ids": ids}, params)

    # ---- generation ---------------------------------------------------------------------------------

    async def generate(self, prompt: PromptType | ProcessedPrompt, params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """RequestOutput deltas (text and tokens new since the last one); the last has finished=True.

        With n > 1, each output carries one sample's delta (its `index`); `finished` is set once all
        samples are done."""
        if self.errored:
            raise EngineDeadError(self.dead_reason)
        self._ensure_started()
        p = self.process_inputs(prompt, params)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = self._add(request_id, p)
        getter: asyncio.Future | None = None  # kept across timeouts, so that no output is ever lost
        try:
            while True:
                if getter is None:
                    getter = asyncio.ensure_future(stream.queue.get())
                done, _ = await asyncio.wait((getter,), timeout=_WAIT_S)
                if not done:
                    if self.errored:
                        raise EngineDeadError(self.dead_reason)
                    continue
                item, getter = getter.result(), None
                if isinstance(item, BaseException):
                    raise item
                if item.finished:  # the last one: clean up before handing it out
                    self._remove(stream)
                    yield item
                    return
                yield item
        finally:
            if getter is not None:
                getter.cancel()
            self._remove(stream)

    def _add(self, request_id: str, p: ProcessedPrompt) -> _Stream:
        params = p.params
        now = time.monotonic()
        children = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        stream = _Stream(request_id, children, RequestStats(now, len(p.token_ids)), unfinished=set(children))
        self._streams[request_id] = stream
        wall = time.time()
        rank = None  # the rank of the first sample takes them all
        for index, child_id in enumerate(children):
            child_params = params
            if params.n > 1:  # as LLM: n samples are n requests; seeded ones get seed + index
                seed = None if params.seed is None else params.seed + index
                child_params = dataclasses.replace(params, n=1, seed=seed)
            self._parent_of[child_id] = request_id
            self.output_processor.add_request(child_id, p.text, p.token_ids, child_params, index=index)
            try:
                request = m.EngineCoreRequest(child_id, p.token_ids, m.params_to_dict(child_params), wall)
                rank = self.client.add_request(request, rank)
            except EngineDeadError:
                self._remove(stream)
                raise
        if len(self._streams) == 1:
            self._last_progress = now
        return stream

    def _remove(self, stream: _Stream) -> None:
        """The request is done, failed or abandoned: abort what is still running in the core."""
        if self._streams.get(stream.request_id) is not stream:
            return
        del self._streams[stream.request_id]
        for child in stream.children:
            self._parent_of.pop(child, None)
            self.output_processor.abort(child)
        if stream.unfinished:
            unfinished = sorted(stream.unfinished)
            stream.unfinished.clear()
            stream.stats.finish_reason = stream.stats.finish_reason or "abort"
            if not self.errored:
                try:
                    self.client.abort_requests(unfinished)
                except EngineDeadError:
                    pass
        elif stream.stats.finish_reason is None:
            reasons = stream.reasons
            stream.stats.finish_reason = "stop" if "stop" in reasons else (reasons[0] if reasons else "stop")
        if self.stat_logger is not None:
            self.stat_logger.record_request(stream.stats)

    def _on_outputs(self, outputs: m.EngineCoreOutputs) -> None:
        try:
            self._process_outputs(outputs)
        except Exception as e:  # noqa: BLE001 - a front-end bug must not leave requests waiting forever
            logger.exception("processing engine outputs failed")
            failed = {self._parent_of.get(o.req_id) for o in outputs.outputs} - {None}
            for parent in failed:
                stream = self._streams.get(parent)
                if stream is not None:
                    stream.stats.finish_reason = "error"
                    stream.queue.put_nowait(RuntimeError(f"processing the engine's output failed: {e}"))

    def _process_outputs(self, outputs: m.EngineCoreOutputs) -> None:
        now = time.monotonic()
        self._last_progress = now
        updates = []
        for out in outputs.outputs:
            if out.error is not None:
                stream = self._streams.get(self._parent_of.get(out.req_id, ""))
                self.output_processor.abort(out.req_id)
                if stream is not None:
                    stream.unfinished.discard(out.req_id)
                    stream.stats.finish_reason = "error"
                    stream.queue.put_nowait(ValueError(out.error))
            else:
                updates.append(out)
        results, to_abort = self.output_processor.process(updates, delta=True)
        if to_abort:  # stop strings finished these: the core must stop them too
            try:
                self.client.abort_requests(to_abort)
            except EngineDeadError:
                pass
        for state, result in results:
            parent = self._parent_of.get(state.request_id)
            stream = self._streams.get(parent) if parent is not None else None
            if stream is None:
                continue
            stats = stream.stats
            completion = result.outputs[0]
            if completion.token_ids:
                if stats.first_token_time is None:
                    stats.first_token_time = now
                stats.last_token_time = now
                stats.num_generation_tokens += len(completion.token_ids)
            if result.finished:
                stream.unfinished.discard(state.request_id)
                stream.reasons.append(completion.finish_reason or "stop")
            if len(stream.children) > 1:
                result = dataclasses.replace(result, request_id=stream.request_id, finished=not stream.unfinished)
            stream.queue.put_nowait(result)

    # ---- failure ------------------------------------------------------------------------------------

    def _on_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        error = EngineDeadError(reason)
        for stream in list(self._streams.values()):
            stream.stats.finish_reason = "error"
            stream.queue.put_nowait(error)
        for listener in self.dead_listeners:
            listener(reason)

    async def _watch_stalls(self) -> None:
        while not self.errored:
            await asyncio.sleep(1.0)
            if self._streams and time.monotonic() - self._last_progress > self.stall_timeout_s:
                self._on_dead(f"the engine core produced nothing for {self.stall_timeout_s:.0f} s "
                              f"with {len(self._streams)} requests in flight")

    def fail_all(self, message: str) -> None:
        """End every in-flight request with an error (shutdown past its grace period)."""
        for stream in list(self._streams.values()):
            stream.stats.finish_reason = "abort"
            stream.queue.put_nowait(EngineDeadError(message))

    # ---- utilities ----------------------------------------------------------------------------------

    async def get_stats(self, timeout: float = 5.0) -> dict:
        """The engine's stats, merged over its data-parallel ranks (merge_rank_stats)."""
        self._ensure_started()
        return merge_rank_stats(await self.client.call_utility_all("get_stats", timeout=timeout))

    async def reset_prefix_cache(self, timeout: float = 5.0) -> bool:
        self._ensure_started()
        return all(await self.client.call_utility_all("reset_prefix_cache", timeout=timeout))

    async def call_utility_all(self, method: str, *args, timeout: float = 5.0) -> list:
        """An engine-core utility method on every data-parallel rank: the results by rank."""
        self._ensure_started()
        return await self.client.call_utility_all(method, *args, timeout=timeout)

    def shutdown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        self.client.shutdown()


# Per-rank stats that do not add up over the ranks: a mean, or the worst rank.
_MEAN_STATS = ("kv_cache_usage",)
_MAX_STATS = ("schedule_time_us",)


def merge_rank_stats(per_rank: list[dict]) -> dict:
    """One engine's view of its ranks' stats: counts add up, the KV cache usage is the mean over the
    (equal) caches, the prefix cache hit rate is recomputed from the summed tokens."""
    if len(per_rank) == 1:
        return per_rank[0]
    merged = {}
    for key in per_rank[0]:
        values = [stats[key] for stats in per_rank]
        if key in _MEAN_STATS:
            merged[key] = sum(values) / len(values)
        elif key in _MAX_STATS:
            merged[key] = max(values)
        else:
            merged[key] = sum(values)
    queries = merged.get("prefix_cache_queries", 0)
    merged["prefix_cache_hit_rate"] = merged.get("prefix_cache_hits", 0) / queries if queries else 0.0
    merged["data_parallel_size"] = len(per_rank)
    return merged
