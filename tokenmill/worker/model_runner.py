"""The model runner: persistent batch → padded device inputs → jitted forward + on-device sampling.

Every step pads the number of scheduled tokens (and, tied to it, the number of request rows) and
the width of the block tables up to short bucket lists, so a handful of shapes are compiled once
(at start-up unless TOKENMILL_SKIP_PRECOMPILE=1) and reused; TOKENMILL_CHECK_RECOMPILATION=1 turns
any later compilation into an error. Only sampled ids and requested logprobs come back to the host.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import threading
import time
import weakref
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tokenmill import envs
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.step_io import Logprobs, ModelRunnerOutput, SchedulerOutput
from tokenmill.distributed.mesh import make_mesh
from tokenmill.model.loader import LoadedModel
from tokenmill.model.registry import get_model_module
from tokenmill.ops.attention import AttentionMetadata, OutputRows, cache_storage_dtype
from tokenmill.ops.cpu.lazy_zeros import zeros as lazy_zeros
from tokenmill.ops.sampler import SamplerOutput, compute_prompt_logprobs, sample
from tokenmill.worker.buckets import block_buckets, pick_bucket, pow2_at_least, token_buckets
from tokenmill.worker.huge_pages import ask_for_huge_pages, move_to_huge_pages
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.sampling_metadata import build_sampling_metadata, round_num_logprobs

logger = logging.getLogger(__name__)

# Runners that may still be compiling on a daemon thread. At interpreter exit such a thread, inside
# XLA when it next takes the GIL, is ended by a forced unwind that XLA's C++ swallows: the process
# aborts (exit status 134, "FATAL: exception not rethrown"; 2 of 6 short offline scripts did).
_PRECOMPILING: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_precompiling_at_exit() -> None:
    """Stop every background precompilation and wait for the shape in progress."""
    for runner in list(_PRECOMPILING):
        runner.shutdown()
        runner.wait_precompiled()


KV_CACHE_SPEC = P(None, None, None, "model", None)  # KV heads over the "model" axis
# Sampler variants compiled at start-up; penalties, logit bias and logprobs compile on first use.
PRECOMPILED_SAMPLER_MODES = ("greedy", "random")


def compute_dtype(dtype: str = "auto"):
    """float32 on CPUs (no native bf16: bf16 matmuls measured ~100x slower), bfloat16 on GPU/TPU."""
    if dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return jnp.dtype(dtype)


# (uint8: 4-bit codes, two per byte)
_QUANTIZED_DTYPES = frozenset(jnp.dtype(t) for t in (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.uint8))


def param_dtype(name: str, x: np.ndarray, dtype):
    """The device dtype of a weight: quantized weights keep their storage type and their scales
    and offsets stay float32; everything else computes in `dtype`."""
    if jnp.dtype(x.dtype) in _QUANTIZED_DTYPES or name.endswith(("_scale", "_offset")):
        return x.dtype
    return dtype


def _under_mesh(method):
    """Trace under the runner's mesh (`jax.set_mesh`): the ops that shard by hand (the attention
    kernel, expert-parallel MoE) read it from there."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with jax.set_mesh(self.mesh):
            return method(self, *args, **kwargs)

    return wrapper


def _padded(a: np.ndarray, n: int, fill: int = 0) -> np.ndarray:
    """int32 `a` padded along its first axis to n entries of `fill` (np.pad costs ~10 µs a call, and a
    decode step pads six arrays)."""
    out = np.full((n, *a.shape[1:]), fill, np.int32)
    out[: len(a)] = a
    return out


def kv_cache_dtype(kv_cache_dtype: str, dtype: str = "auto"):
    """The KV caches' dtype: `kv_cache_dtype`, or the compute dtype for "auto"."""
    return jnp.dtype(compute_dtype(dtype) if kv_cache_dtype == "auto" else kv_cache_dtype)


def kv_block_bytes(model: LoadedModel, block_size: int, dtype) -> int:
    cfg = model.config
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


@dataclass
class StepInFlight:
    """A launched step: what is needed to collect its results."""

    req_ids: list[str]
    rows: np.ndarray
    samples: np.ndarray  # per request: does it sample a token this step
    params: list
    sampler_out: SamplerOutput | None  # device arrays until fetched
    prompt_logprobs: dict
    index_of: dict[str, int]  # request id → its row in the sampler output (sampling requests)
    sampled_padded: jax.Array | None = None
    # speculative decoding: request id → its proposed tokens; their picks follow its row
    drafts: dict[str, list[int]] = dataclasses.field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: LoadedModel,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        dtype: str = "auto",
        mesh: Mesh | None = None,
    ):
        self.cfg = model.config
        self.module = get_model_module(self.cfg)
        self.mesh = mesh or make_mesh(1)
        self.dtype = compute_dtype(dtype)
        self.kv_dtype = kv_cache_dtype(cache_config.kv_cache_dtype, dtype)
        kv_storage = cache_storage_dtype(self.kv_dtype)
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        self.max_model_len = scheduler_config.max_model_len
        self.max_num_seqs = scheduler_config.max_num_seqs
        max_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.token_buckets = token_buckets(scheduler_config.max_num_batched_tokens)
        self.block_buckets = block_buckets(max_blocks_per_req)
        self.batch = InputBatch(self.max_num_seqs, self.max_model_len, max_blocks_per_req)

        specs = self.module.param_specs(self.cfg)
        self.params = jax.tree.map_with_path(
            lambda path, x, spec: jax.device_put(
                np.asarray(x, dtype=param_dtype(path[-1].key, x, self.dtype)), NamedSharding(self.mesh, spec)
            ),
            model.params,
            specs,
        )
        self.params = self.module.to_kernel_layout(self.params, self.mesh, int16=self.cfg.int16_inputs)
        cache_shape = (self.cfg.num_layers, num_blocks, self.block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        cache_sharding = NamedSharding(self.mesh, KV_CACHE_SPEC)
        self.k_cache = lazy_zeros(cache_shape, kv_storage, cache_sharding)
        self.v_cache = lazy_zeros(cache_shape, kv_storage, cache_sharding)
        ask_for_huge_pages((self.k_cache, self.v_cache))  # as its pages are first written (the weights': precompile)
        # what compiling a step needs of the params and caches: the caches are donated to every
        # step, so a compile on the precompiling thread must not touch the arrays themselves
        cache_spec = jax.ShapeDtypeStruct(cache_shape, kv_storage, sharding=cache_sharding)
        self._step_operand_specs = (
            jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.params),
            cache_spec,
            cache_spec,
        )

        cfg, module = self.cfg, self.module

        def step(params, k_cache, v_cache, input_ids, md, out_rows, logits_indices, prev_sampled, placeholder_src,
                 argmax_only):
            # tokens still being sampled by the previous step come from its device output
            prev = jnp.take(prev_sampled, jnp.maximum(placeholder_src, 0))
            input_ids = jnp.where(placeholder_src >= 0, prev, input_ids)
            hidden, k_cache, v_cache = module.forward(params, cfg, k_cache, v_cache, input_ids, md, out_rows)
            # argmax_only: the sampler takes nothing but the logits' argmax (its "greedy" mode, no logprobs)
            logits = module.compute_logits(params, cfg, hidden[logits_indices], greedy=argmax_only)
            return logits, hidden, k_cache, v_cache

        def prompt_logprobs(params, hidden, targets, num_logprobs):
            return compute_prompt_logprobs(module.compute_logits(params, cfg, hidden), targets, num_logprobs)

        max_rows = pow2_at_least(self.max_num_seqs)

        def sample_step(logits, md, mode, num_logprobs):
            out = sample(logits, md, mode=mode, num_logprobs=num_logprobs)
            # a fixed-size copy of the sampled ids, so the next step's input (placeholder tokens)
            # does not multiply the compiled step shapes by the row buckets
            return out, jnp.pad(out.sampled, (0, max_rows - out.sampled.shape[0]))

        self._step = jax.jit(step, donate_argnums=(1, 2))
        self._sample = jax.jit(sample_step, static_argnames=("mode", "num_logprobs"))
        self._no_prev_sampled = jnp.zeros(max_rows, jnp.int32)
        self._last_launched: StepInFlight | None = None
        self._prompt_logprobs = jax.jit(prompt_logprobs, static_argnames=("num_logprobs",))
        self._executables: dict[tuple[int, int], jax.stages.Compiled] = {}
        # one compile at a time: a step may need the shape the precompiling thread is on
        self._compile_lock = threading.Lock()
        self._precompiler: threading.Thread | None = None
        self._stop_precompiling = threading.Event()
        self._warmed_up = False
        self._sampler_compiled = 0

    # ---- compilation -------------------------------------------------------------------------

    def _executable(self, num_tokens: int, width: int):
        """The compiled step for one (token bucket, block-table width) shape, compiled ahead of time
        (lowered and compiled without running, so warm-up costs compile time only)."""
        exe = self._executables.get((num_tokens, width))
        if exe is not None:
            return exe
        with self._compile_lock:
            exe = self._executables.get((num_tokens, width))
            if exe is None:
                if self._warmed_up and envs.TOKENMILL_CHECK_RECOMPILATION:
                    raise RuntimeError(
                        f"recompilation after warm-up: step shape (tokens={num_tokens}, blocks={width}) "
                        "escaped the precompiled buckets"
                    )
                inputs = self._dummy_inputs(num_tokens, self._rows_for(num_tokens), width)
                exe = self._step.lower(*self._step_operand_specs, *inputs).compile()
                self._executables[(num_tokens, width)] = exe
        return exe

    def _sampler_cache_size(self) -> int:
        return self._sample._cache_size() + self._prompt_logprobs._cache_size()

    def precompile(self, background: bool = False) -> None:
        """Compile every bucket, so that serving never stops to compile: now, or on a thread while
        the engine already serves (`background`; a step whose shape is not compiled yet compiles
        it first, and the first token does not wait for the other shapes). Then move the weights
        onto 2 MiB pages (worker/huge_pages.py): after the compiles, so that neither they nor the
        first tokens share the cores with it."""
        if envs.TOKENMILL_SKIP_PRECOMPILE:
            logger.info("skipping precompilation (TOKENMILL_SKIP_PRECOMPILE=1)")
            self._finish_warm_up()
            work = self._weights_to_huge_pages
        else:
            work = self._precompile_all
        if background:
            self._precompiler = threading.Thread(target=work, name="tokenmill-precompile", daemon=True)
            self._precompiler.start()
            _PRECOMPILING.add(self)
        else:
            work()

    def wait_precompiled(self) -> None:
        """Block until precompilation (if it runs in the background) is over, and the move of the weights
        onto 2 MiB pages that follows it."""
        if self._precompiler is not None:
            self._precompiler.join()

    def precompiling(self) -> bool:
        return self._precompiler is not None and self._precompiler.is_alive()

    def shutdown(self) -> None:
        """Stop precompiling in the background (after the shape in progress); safe to call more than once."""
        self._stop_precompiling.set()

    @_under_mesh
    def _precompile_all(self) -> None:
        start = time.perf_counter()
        # the smallest shapes first: those are what the first requests (and every decode) need
        for num_tokens in self.token_buckets:
            rows = self._rows_for(num_tokens)
            for width in self.block_buckets:
                if self._stop_precompiling.is_set():
                    return
                exe = self._executable(num_tokens, width)
            # the sampler's cache is keyed by its inputs' shardings too: match the step's output
            logits = jax.device_put(jnp.zeros((rows, self.cfg.vocab_size), jnp.float32), exe.output_shardings[0])
            md, _, _ = build_sampling_metadata([], [], [], [], [], rows, self.cfg.vocab_size)
            for mode in PRECOMPILED_SAMPLER_MODES:
                self._sample(logits, md, mode=mode, num_logprobs=None)
        logger.info(
            "compiled %d token buckets x %d context buckets in %.1f s",
            len(self.token_buckets), len(self.block_buckets), time.perf_counter() - start,
        )
        self._finish_warm_up()
        self._weights_to_huge_pages()

    def _weights_to_huge_pages(self) -> None:
        move_to_huge_pages(self.params, "weights")

    def _finish_warm_up(self) -> None:
        self._sampler_compiled = self._sampler_cache_size()
        self._warmed_up = True

    def _check_no_recompilation(self) -> None:
        if self._warmed_up and envs.TOKENMILL_CHECK_RECOMPILATION:
            if self._sampler_cache_size() != self._sampler_compiled:
                raise RuntimeError("recompilation after warm-up: a sampler variant escaped the precompiled ones")

    def _rows_for(self, num_tokens: int) -> int:
        """Request rows are tied to the token bucket, so each token bucket is one compiled shape."""
        return min(num_tokens, pow2_at_least(self.max_num_seqs))

    def _dummy_inputs(self, num_tokens: int, rows: int, width: int):
        oob = self.num_blocks * self.block_size  # an out-of-range slot: the write is dropped
        md = AttentionMetadata(
            positions=np.zeros(num_tokens, np.int32),
            slot_mapping=np.full(num_tokens, oob, np.int32),
            token_request=np.zeros(num_tokens, np.int32),
            block_tables=np.zeros((rows, width), np.int32),
            num_tokens=np.int32(num_tokens),
        )
        out_rows = OutputRows(np.zeros(num_tokens, np.int32), np.int32(0))
        return (np.zeros(num_tokens, np.int32), md, out_rows, np.zeros(rows, np.int32), self._no_prev_sampled,
                np.full(num_tokens, -1, np.int32), np.False_)

    # ---- one step ----------------------------------------------------------------------------

    @_under_mesh
    def execute_dummy_batch(self) -> None:
        """One forward over the smallest shape bucket with padding inputs only: it writes no KV (the
        slots are out of range) and its output is dropped."""
        num_tokens, width = self.token_buckets[0], self.block_buckets[0]
        step = self._executable(num_tokens, width)
        inputs = self._dummy_inputs(num_tokens, self._rows_for(num_tokens), width)
        logits, _, self.k_cache, self.v_cache = step(self.params, self.k_cache, self.v_cache, *inputs)
        logits.block_until_ready()

    def _update_batch(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.batch.remove(req_id)
        for new in so.new_requests:
            self.batch.add(new)
        for cached in so.cached_requests:
            if cached.new_block_ids:
                self.batch.append_blocks(cached.req_id, cached.new_block_ids)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.finish(self.launch(so))

    @_under_mesh
    def launch(self, so: SchedulerOutput) -> StepInFlight:
        """Prepare and dispatch one step without waiting for it (JAX dispatches asynchronously).

        A scheduled position whose token is still being sampled by the previous, unfinished step
        (async scheduling) takes that token from the previous step's device output.
        """
        self._update_batch(so)
        b = self.batch
        for req_id, drafts in so.spec_token_ids.items():  # proposals go after the known tokens
            row = b.row_of[req_id]
            b.token_ids[row, b.num_tokens[row] : b.num_tokens[row] + len(drafts)] = drafts
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return StepInFlight(req_ids, np.zeros(0, np.int32), np.zeros(0, bool), [], None, {}, {})
        rows = np.array([b.row_of[r] for r in req_ids], np.int32)
        counts = np.array([so.num_scheduled_tokens[r] for r in req_ids], np.int32)
        total = int(counts.sum())
        num_tokens = pick_bucket(self.token_buckets, total)
        num_rows = self._rows_for(num_tokens)
        if len(req_ids) > num_rows:
            raise RuntimeError(f"{len(req_ids)} requests exceed the {num_rows} rows of bucket {num_tokens}")

        starts = b.num_computed[rows]
        ends = starts + counts
        token_request = np.repeat(np.arange(len(req_ids), dtype=np.int32), counts)
        positions = (np.arange(total, dtype=np.int32) - np.repeat(np.cumsum(counts) - counts, counts)) + np.repeat(
            starts, counts
        )
        token_rows = rows[token_request]
        input_ids = b.token_ids[token_rows, np.minimum(positions, self.max_model_len - 1)]
        slots = b.block_table[token_rows, positions // self.block_size] * self.block_size + positions % self.block_size
        width = pick_bucket(self.block_buckets, int(-(-ends.max() // self.block_size)))

        # positions past the host-known tokens: tokens the previous step is sampling right now,
        # or proposed tokens
        placeholder_src = np.full(num_tokens, -1, np.int32)
        pending = positions >= b.num_tokens[token_rows]
        num_drafts = np.zeros(len(req_ids), np.int32)
        if so.spec_token_ids:
            num_drafts[:] = [len(so.spec_token_ids.get(r, ())) for r in req_ids]
            pending &= num_drafts[token_request] == 0
        prev_sampled = self._no_prev_sampled
        if pending.any():
            prev = self._last_launched
            if prev is None or prev.sampled_padded is None:
                raise RuntimeError("a placeholder token was scheduled but no step is in flight")
            for t in np.flatnonzero(pending):
                req_id = req_ids[token_request[t]]
                if positions[t] != b.num_tokens[token_rows[t]] or req_id not in prev.index_of:
                    raise RuntimeError(f"request {req_id!r}: position {positions[t]} is not the token in flight")
                placeholder_src[t] = prev.index_of[req_id]
            prev_sampled = prev.sampled_padded

        oob = self.num_blocks * self.block_size
        md = AttentionMetadata(
            positions=_padded(positions, num_tokens),
            slot_mapping=_padded(slots, num_tokens, oob),
            token_request=_padded(token_request, num_tokens),
            block_tables=_padded(b.block_table[rows, :width], num_rows),
            num_tokens=np.int32(total),
        )
        # the final hidden states the step needs: each request's last row (its logits), and the
        # rows of its proposed tokens before it; or every row when a request wants its prompt's
        # logprobs
        last_rows = np.cumsum(counts) - 1
        logit_rows_per_req = 1 + num_drafts
        first_logit_row = np.cumsum(logit_rows_per_req) - logit_rows_per_req  # each request's first
        # logits row first_logit_row[i] + j: request i's token j rows before its last
        logit_tokens = np.repeat(last_rows - num_drafts - first_logit_row, logit_rows_per_req) + np.arange(
            logit_rows_per_req.sum())
        if len(logit_tokens) > num_rows:
            raise RuntimeError(f"{len(logit_tokens)} logits rows exceed the {num_rows} rows of bucket {num_tokens}")
        prompt_lp_targets, prompt_lp_wanted = self._plan_prompt_logprobs(req_ids, rows, starts, counts, num_tokens)
        if prompt_lp_wanted:
            out_rows = OutputRows(np.arange(num_tokens, dtype=np.int32), np.int32(total))
            logits_indices = _padded(logit_tokens, num_rows)
        else:
            out_rows = OutputRows(_padded(logit_tokens, num_tokens), np.int32(len(logit_tokens)))
            logits_indices = np.arange(num_rows, dtype=np.int32)
        # Requests whose known tokens (in flight included) are all computed after this step sample.
        in_flight = b.num_pending[rows]
        samples = ends >= b.num_tokens[rows] + in_flight
        params = [b.params[r] for r in rows]
        steps = [int(b.num_tokens[r] - b.num_prompt_tokens[r] + b.num_pending[r]) for r in rows]
        seeds = [int(b.seeds[r]) for r in rows]
        prompts = [b.prompt_ids(r) for r in rows]
        outputs = [np.concatenate([b.output_ids(r), np.full(b.num_pending[r], -1)]) for r in rows]
        row_params = params
        if so.spec_token_ids:
            # one sampler row per logits row: a request's row j samples as if its first j
            # proposals were its latest tokens
            row_req = np.repeat(np.arange(len(req_ids)), logit_rows_per_req)
            row_j = np.arange(len(row_req)) - first_logit_row[row_req]
            drafts = [np.asarray(so.spec_token_ids.get(r, ()), np.int64) for r in req_ids]
            row_params = [params[i] for i in row_req]
            steps = [steps[i] + j for i, j in zip(row_req, row_j)]
            seeds = [seeds[i] for i in row_req]
            prompts = [prompts[i] for i in row_req]
            outputs = [np.concatenate([outputs[i], drafts[i][:j]]) for i, j in zip(row_req, row_j)]
        sampling_md, mode, num_logprobs = build_sampling_metadata(
            row_params, steps, seeds, prompts, outputs, num_rows, self.cfg.vocab_size,
            eos_token_ids=self.cfg.eos_token_ids,
        )
        step = self._executable(num_tokens, width)
        logits, hidden, self.k_cache, self.v_cache = step(
            self.params, self.k_cache, self.v_cache, _padded(input_ids, num_tokens), md, out_rows, logits_indices,
            prev_sampled, placeholder_src, np.bool_(mode == "greedy" and num_logprobs is None),
        )
        sampler_out, sampled_padded = self._sample(logits, sampling_md, mode=mode, num_logprobs=num_logprobs)
        prompt_lp = self._prompt_logprobs_for(hidden, prompt_lp_targets, prompt_lp_wanted)
        b.num_computed[rows] = ends
        b.num_pending[rows[samples]] += 1
        handle = StepInFlight(
            req_ids, rows, samples, params, sampler_out, prompt_lp,
            {r: int(first_logit_row[i]) for i, r in enumerate(req_ids) if samples[i]}, sampled_padded,
            dict(so.spec_token_ids),
        )
        self._last_launched = handle
        return handle

    def finish(self, handle: StepInFlight) -> ModelRunnerOutput:
        """Wait for a launched step; append its tokens to the persistent batch; report them."""
        result = ModelRunnerOutput(sampled_token_ids={})
        if handle.sampler_out is None:
            return result
        out = jax.device_get(handle.sampler_out)
        prompt_lp = jax.device_get(handle.prompt_logprobs)
        self._check_no_recompilation()
        b = self.batch
        for i, (req_id, row) in enumerate(zip(handle.req_ids, handle.rows)):
            if not handle.samples[i]:
                continue
            k = handle.index_of[req_id]
            tokens = [int(out.sampled[k])]
            drafts = handle.drafts.get(req_id, ())
            for j, proposed in enumerate(drafts):  # keep proposals while they are the model's picks
                if tokens[-1] != proposed:
                    break
                tokens.append(int(out.sampled[k + j + 1]))
            result.sampled_token_ids[req_id] = tokens[0]
            if len(tokens) > 1:
                result.spec_token_ids[req_id] = tokens[1:]
            if b.row_of.get(req_id) == row:  # still held (not finished or preempted meanwhile)
                b.num_pending[row] -= 1
                b.num_computed[row] -= len(drafts) - (len(tokens) - 1)  # rejected proposals' KV is stale
                for token in tokens:
                    b.append_token(row, token)
            wanted = handle.params[i].logprobs
            if wanted is not None:  # of each token kept: rows k, k + 1, ...
                result.logprobs[req_id] = [
                    Logprobs(
                        token_ids=[int(t) for t in out.logprob_ids[k + j, : wanted + 1]],
                        logprobs=[float(x) for x in out.logprobs[k + j, : wanted + 1]],
                        rank=int(out.sampled_rank[k + j]),
                    )
                    for j in range(len(tokens))
                ]
        result.prompt_logprobs = self._convert_prompt_logprobs(prompt_lp)
        if self._last_launched is handle:
            self._last_launched = None
        return result

    def _plan_prompt_logprobs(self, req_ids, rows, starts, counts, num_tokens) -> tuple[np.ndarray, dict]:
        """The prompt tokens whose logprobs this step computes, for requests that asked: (the target
        token of each row [num_tokens], request id → (first row, number of positions, top-N))."""
        b = self.batch
        wanted = {}
        offset = 0
        targets = np.zeros(num_tokens, np.int32)
        for req_id, row, start, count in zip(req_ids, rows, starts, counts):
            n_prompt = b.num_prompt_tokens[row]
            p = b.params[row]
            # position `pos` predicts token pos + 1; only positions that predict a prompt token count
            last = min(start + count, n_prompt - 1)
            if p.prompt_logprobs is not None and start < last:
                n = last - start
                targets[offset : offset + n] = b.token_ids[row, start + 1 : last + 1]
                wanted[req_id] = (offset, n, p.prompt_logprobs)
            offset += count
        return targets, wanted

    def _prompt_logprobs_for(self, hidden, targets: np.ndarray, wanted: dict) -> dict:
        """Dispatch the planned prompt logprobs: request id → (device arrays, first row, number of
        positions, top-N)."""
        if not wanted:
            return {}
        k = round_num_logprobs(max(w[2] for w in wanted.values()))
        arrays = self._prompt_logprobs(self.params, hidden, targets, num_logprobs=k)
        return {req_id: (arrays, *w) for req_id, w in wanted.items()}

    @staticmethod
    def _convert_prompt_logprobs(fetched: dict) -> dict[str, list[Logprobs]]:
        result = {}
        for req_id, ((lp, ids, ranks), offset, n, top) in fetched.items():
            result[req_id] = [
                Logprobs(
                    token_ids=[int(t) for t in ids[i, : top + 1]],
                    logprobs=[float(x) for x in lp[i, : top + 1]],
                    rank=int(ranks[i]),
                )
                for i in range(offset, offset + n)
            ]
        return result
