"""A request as the scheduler sees it: token ids, progress, status. Plain Python."""

from __future__ import annotations

import enum
from typing import Hashable

from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue; its KV blocks were freed, its output tokens kept
    # every status from here on is finished
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence. `all_token_ids` is the prompt followed by the output tokens so far.

    `num_computed_tokens` counts tokens whose KV is in the cache or scheduled to be written there
    (the scheduler advances it when it schedules them, so the next `schedule()` may run before the
    step's output is back). `max_tokens` is None until the scheduler resolves it against
    max_model_len (None in the sampling parameters means "up to max_model_len").
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float = 0.0,
        seed: int = 0,
        lora_id: Hashable | None = None,
        priority: int = 0,
    ):
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.arrival_time = arrival_time
        self.seed = seed
        self.lora_id = lora_id
        self.priority = priority  # lower values are served first (vLLM's convention)

        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # tokens being sampled by steps in flight, not yet appended (async scheduling): the next
        # step may already compute at their positions, the runner filling them in on device
        self.num_output_placeholders = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first admission
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None  # the stop token id that finished it, if one did
        self.num_preemptions = 0
        self.max_tokens: int | None = sampling_params.max_tokens
        # Hashes of the request's full blocks, in order, filled in by the KV cache manager as
        # tokens fill blocks (output tokens included). Valid for one block size.
        self.block_hashes: list[bytes] = []
        # prompt logprobs: positions seen in the current pass / delivered overall (a request that
        # is preempted recomputes its prompt; what was already delivered is not sent again)
        self._prompt_lp_pos = 0
        self._prompt_lp_delivered = 0

    # ---- sizes ----------------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    # ---- state ----------------------------------------------------------------------------------

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """ "stop" | "length" | "abort", or None while unfinished."""
        return self.status.finish_reason

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __lt__(self, other: Request) -> bool:  # for the priority queue
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
