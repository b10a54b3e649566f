"""The scheduler: one token-budget rule, chunked prefill, prefix caching and preemption.

Each step, every scheduled request's computed tokens catch up with its known tokens (prompt plus
outputs), within `max_num_batched_tokens` and `max_num_seqs`. Running requests go first, in order;
then waiting requests while budget, seats and blocks remain. A prompt longer than the budget is
computed in chunks over several steps, riding along with the decodes. When blocks run out, the
most recently admitted running request is preempted: its blocks are freed, it keeps its output
tokens, and it goes back to the head of the waiting queue to be recomputed later.

`schedule()` advances `num_computed_tokens` as it schedules (as vLLM v1 does), and
`update_from_output()` only appends sampled tokens and checks for the end; so a next `schedule()`
may run while a step is still in flight (one step ahead at most: `update_from_output` of step N
must come before `schedule()` of step N+2).

Speculative decoding: with a `speculative_config`, a decoding request is scheduled with its
proposed tokens too, 1 + k tokens; `update_from_output` appends what the step verified and takes
the rejected proposals back out of `num_computed_tokens` (their KV slots are overwritten later).
The runner keeps a proposal when the model's own pick at its position takes it: the argmax, or the
row's draw, whose key (seed, step) is the one plain decoding would use at that step
(ops/sampler.py), with the proposals before it as the latest tokens (penalties, min_tokens). Every
kept token, and the first pick that differs, is thus what plain decoding would have picked:
greedy and seeded outputs (and logprobs) are plain decoding's. Proposals need the request's latest
tokens on the host, so the engine then runs one step at a time (no step in flight when
`schedule()` proposes).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from tokenmill.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.ngram_proposer import propose_ngram
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.step_io import (
    CachedRequestData,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

POLICIES = ("fcfs", "priority")


@dataclass
class RequestUpdate:
    """What one step changed for one request; the engine turns it into its output message."""

    req_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None  # the stop token id that finished it (None for EOS)
    logprobs: list[Logprobs] | None = None  # of each new token
    prompt_logprobs: list[Logprobs] | None = None  # of the prompt positions computed this step
    num_cached_tokens: int = 0


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable blocks in use
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    prefix_cache_hit_rate: float
    num_preemptions: int  # total since start
    schedule_time_us: float  # host time of the last schedule()
    num_draft_tokens: int = 0  # speculative decoding: tokens proposed and computed, since start
    num_accepted_tokens: int = 0  # of those, the ones the model agreed with


class _WaitingQueue:
    """FCFS (a deque) or priority (a heap on (priority, arrival time, id))."""

    def __init__(self, policy: str):
        self.priority = policy == "priority"
        self._q: deque[Request] | list[Request] = [] if self.priority else deque()

    def add(self, req: Request) -> None:
        if self.priority:
            heapq.heappush(self._q, req)
        else:
            self._q.append(req)

    def prepend(self, req: Request) -> None:
        """A preempted request: back to the head (by priority under the priority policy)."""
        if self.priority:
            heapq.heappush(self._q, req)
        else:
            self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return heapq.heappop(self._q) if self.priority else self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)
        if self.priority:
            heapq.heapify(self._q)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(sorted(self._q) if self.priority else self._q)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        policy: str = "fcfs",
        speculative_config: SpeculativeConfig | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.config = scheduler_config
        self.max_model_len = scheduler_config.max_model_len
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.block_size = cache_config.block_size
        self.policy = policy
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, enable_prefix_caching)

        self.requests: dict[str, Request] = {}  # unfinished requests
        self.waiting = _WaitingQueue(policy)
        self.running: list[Request] = []  # admission order (priority order under "priority")
        # finished, aborted or preempted since the last schedule(): the runner drops them
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.last_schedule_time_us = 0.0
        self.speculative = speculative_config
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # ---- requests in and out --------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        n = request.num_prompt_tokens
        if request.max_tokens is None:
            if n >= self.max_model_len:
                raise ValueError(
                    f"request {rid!r}: the prompt ({n} tokens) leaves no room to generate within "
                    f"max_model_len={self.max_model_len}"
                )
            request.max_tokens = self.max_model_len - n
        elif n + request.max_tokens > self.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt ({n} tokens) + max_tokens ({request.max_tokens}) = "
                f"{n + request.max_tokens} exceeds max_model_len={self.max_model_len}"
            )
        # the last output token is sampled, never computed: it needs no KV slot
        blocks_needed = self.kv.cdiv_blocks(n + request.max_tokens - 1)
        if blocks_needed > self.kv.num_usable_blocks:
            raise ValueError(
                f"request {rid!r}: prompt ({n} tokens) + max_tokens ({request.max_tokens}) needs "
                f"{blocks_needed} KV blocks of {self.block_size} tokens, but the whole cache has "
                f"{self.kv.num_usable_blocks}"
            )
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self.waiting.add(request)

    def finish_requests(
        self, req_ids: str | Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[str]:
        """Finish (by default abort) requests; their blocks are freed now. Unknown ids are ignored.

        Returns the ids that were finished by this call.
        """
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status.name}")
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        done = []
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            self._finish(req, status)
            done.append(rid)
        return done

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Take the request out of running or waiting, mark it finished, free its blocks now."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self.finished_req_ids.add(req.request_id)  # the runner holds it: drop it
        else:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        del self.requests[req.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        spec_tokens: dict[str, list[int]] = {}
        num_drafts = 0  # every draft token takes a logits row: all rows stay within max_num_seqs
        preempted = False

        # 1. running requests, in order
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens + req.num_output_placeholders - req.num_computed_tokens, budget)
            if n <= 0 or self._at_length_limit(req):  # its last token is being sampled already
                i += 1
                continue
            drafts = []
            if n == 1 and self.speculative is not None and req.num_output_placeholders == 0:
                room = self.max_num_seqs - len(self.running) - num_drafts
                drafts = self._propose(req, min(budget - 1, room))
                n += len(drafts)
            while True:
                new_blocks = self.kv.allocate_slots(req, n)
                if new_blocks is not None:
                    break
                if drafts:  # proposals never cost a preemption
                    n -= len(drafts)
                    drafts = []
                    continue
                # The tail is always at or after i: a victim was never scheduled in this step.
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if new_blocks is None:
                break
            num_scheduled[req.request_id] = n
            cached_reqs.append(CachedRequestData(req.request_id, new_blocks))
            if drafts:
                spec_tokens[req.request_id] = drafts
                num_drafts += len(drafts)
            budget -= n
            i += 1

        # 2. waiting requests (none in a step that preempted: the blocks are short)
        while not preempted and self.waiting and budget > 0 and len(self.running) + num_drafts < self.max_num_seqs:
            req = self.waiting.peek()
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, budget)
            new_blocks = self.kv.allocate_slots(req, n, hit_blocks)
            if new_blocks is None:
                break
            self.waiting.pop()
            if req.status == RequestStatus.WAITING:  # first admission (not a resume)
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            req._prompt_lp_pos = num_hit
            self._add_running(req)
            new_reqs.append(
                NewRequestData(
                    req_id=req.request_id,
                    token_ids=list(req.all_token_ids),
                    num_prompt_tokens=req.num_prompt_tokens,
                    sampling_params=req.sampling_params,
                    seed=req.seed,
                    block_ids=self.kv.get_block_ids(req.request_id),
                    num_computed_tokens=num_hit,
                )
            )
            num_scheduled[req.request_id] = n
            budget -= n

        # 3. the scheduled tokens count as computed from now on; a request whose every known
        # token (placeholders included) is then computed samples one more: a new placeholder
        for rid, n in num_scheduled.items():
            req = self.requests[rid]
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens + req.num_output_placeholders:
                req.num_output_placeholders += 1

        out = SchedulerOutput(
            new_requests=new_reqs,
            cached_requests=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            finished_req_ids=self.finished_req_ids,
            spec_token_ids=spec_tokens,
        )
        self.finished_req_ids = set()
        self.last_schedule_time_us = (time.perf_counter() - t0) * 1e6
        return out

    def _propose(self, req: Request, max_drafts: int) -> list[int]:
        """Proposed tokens for a decoding request: none past its max_tokens (the last token is
        sampled, never computed) or max_model_len, at most `max_drafts`."""
        spec = self.speculative
        k = min(spec.num_speculative_tokens, max_drafts, req.max_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_tokens)
        if k <= 0:
            return []
        return propose_ngram(req.all_token_ids, spec.prompt_lookup_min, spec.prompt_lookup_max, k)

    def _add_running(self, req: Request) -> None:
        if self.policy == "priority":  # keep the lowest priority at the tail: it is preempted first
            j = len(self.running)
            while j > 0 and req < self.running[j - 1]:
                j -= 1
            self.running.insert(j, req)
        else:
            self.running.append(req)

    def _at_length_limit(self, req: Request) -> bool:
        """Steps in flight will already produce the request's last allowed token."""
        pending = req.num_output_tokens + req.num_output_placeholders
        return req.num_output_placeholders > 0 and (
            pending >= req.max_tokens or req.num_tokens + req.num_output_placeholders >= self.max_model_len
        )

    def _preempt(self, req: Request) -> None:
        """Recompute later: free the blocks, keep the output tokens, back to the waiting head."""
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.finished_req_ids.add(req.request_id)
        self.waiting.prepend(req)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Append the sampled tokens, finish requests that stop, free their blocks."""
        updates = []
        sampled = runner_output.sampled_token_ids
        for rid in scheduler_output.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None:  # finished (aborted) since it was scheduled
                continue
            new_tokens: list[int] = []
            status = None
            token = sampled.get(rid)
            if token is not None:
                req.num_output_placeholders = max(0, req.num_output_placeholders - 1)
                accepted = runner_output.spec_token_ids.get(rid, [])
                drafts = scheduler_output.spec_token_ids.get(rid)
                if drafts:
                    self.num_draft_tokens += len(drafts)
                    self.num_accepted_tokens += len(accepted)
                    if req.status == RequestStatus.RUNNING:  # the rejected proposals' KV is not valid
                        req.num_computed_tokens -= len(drafts) - len(accepted)
                for token in (token, *accepted):
                    req.append_output_token(token)
                    new_tokens.append(token)
                    status = self._check_stop(req)
                    if status is not None:  # tokens verified past the end are dropped
                        break
            prompt_lp = self._new_prompt_logprobs(req, runner_output.prompt_logprobs.get(rid))
            finished = status is not None
            if finished:  # a request preempted while its step was in flight may finish too
                self._finish(req, status)
            if new_tokens or finished or prompt_lp:
                updates.append(
                    RequestUpdate(
                        req_id=rid,
                        new_token_ids=new_tokens,
                        finished=finished,
                        finish_reason=req.finish_reason,
                        stop_reason=req.stop_reason,
                        logprobs=runner_output.logprobs[rid][: len(new_tokens)]
                        if new_tokens and rid in runner_output.logprobs else None,
                        prompt_logprobs=prompt_lp,
                        num_cached_tokens=req.num_cached_tokens,
                    )
                )
        return updates

    def _new_prompt_logprobs(self, req: Request, lps: list[Logprobs] | None) -> list[Logprobs] | None:
        """Drop positions already delivered before a preemption made the prompt be recomputed."""
        if not lps:
            return None
        start = req._prompt_lp_pos
        req._prompt_lp_pos += len(lps)
        skip = max(0, req._prompt_lp_delivered - start)
        req._prompt_lp_delivered = max(req._prompt_lp_delivered, req._prompt_lp_pos)
        return lps[skip:] or None

    def _check_stop(self, req: Request) -> RequestStatus | None:
        """After appending a token: EOS / stop ids (once min_tokens are out), then the length caps."""
        sp = req.sampling_params
        last = req.output_token_ids[-1]
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and last in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in sp.stop_token_ids:
                req.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- stats ----------------------------------------------------------------------------------

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            prefix_cache_hit_rate=self.kv.prefix_cache_hit_rate,
            num_preemptions=self.num_preemptions,
            schedule_time_us=self.last_schedule_time_us,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
        )
