"""What the scheduler hands the model runner each step, and what comes back. Plain Python."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or one resumed after preemption: its tokens so far)."""

    req_id: str
    token_ids: list[int]  # prompt followed by any output tokens already generated
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int  # concrete: the engine draws one for requests without a seed
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix-cache hits)


@dataclass
class CachedRequestData:
    """A request the runner already holds: the blocks it gained this step."""

    req_id: str
    new_block_ids: list[int]


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # request id → tokens to compute this step, in batch order
    finished_req_ids: set[str] = field(default_factory=set)  # finished, aborted or preempted: drop them
    # speculative decoding: request id → the proposed tokens scheduled after its last known token
    # (they are among its num_scheduled_tokens)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass
class Logprobs:
    """Logprobs of one position: the chosen token first, then the top-N; `rank` of the chosen token."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]  # only requests whose known tokens were all computed this step
    # speculative decoding: more tokens after the sampled one, one per accepted proposal. The
    # sampled token and these are the model's own picks at the scheduled positions, up to and
    # including the first that differs from its proposal; absent when none was accepted
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # requests that asked: the logprobs of the sampled token, then of each of spec_token_ids
    logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    # prompt logprobs of the positions computed this step (a chunk of a long prompt at a time)
    prompt_logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
