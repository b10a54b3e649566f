"""Front-end side of generation: engine updates → RequestOutputs (detokenized, stop strings, logprobs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.core.step_io import Logprobs
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from tokenmill.sampling_params import SamplingParams


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    index: int = 0  # which of the parent's n samples this is
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    sent_text: int = 0  # characters already streamed
    sent_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, index: int = 0) -> None:
        detok = None
        if params.detokenize:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                params.include_stop_str_in_output,
            )
        state = RequestState(request_id, prompt, list(prompt_token_ids), params, detok, index)
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # the first prompt token has no logprob
        self.states[request_id] = state

    def abort(self, request_id: str) -> RequestState | None:
        return self.states.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.states)

    def process(self, updates, delta: bool = False) -> tuple[list[tuple[RequestState, RequestOutput]], list[str]]:
        """Apply engine updates. Returns (state, output) pairs for requests that changed, and the ids
        of requests that a stop string finished (the engine core must abort them)."""
        outputs, to_abort = [], []
        for u in updates:
            state = self.states.get(u.req_id)
            if state is None:  # aborted meanwhile
                continue
            state.num_cached_tokens = u.num_cached_tokens
            if u.prompt_logprobs and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(self._convert(lp) for lp in u.prompt_logprobs)
            for token in u.new_token_ids:
                state.token_ids.append(token)
            if u.logprobs is not None and state.logprobs is not None:
                for lp in u.logprobs:  # one per new token
                    state.logprobs.append(self._convert(lp))
                    state.cumulative_logprob += lp.logprobs[0]
            if u.finished:
                state.finish_reason, state.stop_reason = u.finish_reason, u.stop_reason
            if state.detokenizer is not None and u.new_token_ids:
                stop = state.detokenizer.add_tokens(u.new_token_ids)
                if stop is not None and not u.finished:
                    state.finish_reason, state.stop_reason = "stop", stop
                    to_abort.append(u.req_id)
                elif stop is not None:
                    state.finish_reason, state.stop_reason = "stop", stop
            finished = state.finish_reason is not None
            out = self.make_output(state, delta)
            if out is not None:
                outputs.append((state, out))
            if finished:
                del self.states[u.req_id]
        return outputs, to_abort

    def _convert(self, lp: Logprobs) -> PositionLogprobs:
        result: PositionLogprobs = {}
        for i, (token, value) in enumerate(zip(lp.token_ids, lp.logprobs)):
            rank = lp.rank if i == 0 else i
            if token not in result:
                result[token] = Logprob(value, rank, self.tokenizer.decode([token]))
        return result

    def make_output(self, state: RequestState, delta: bool) -> RequestOutput | None:
        finished = state.finish_reason is not None
        text = state.detokenizer.text if state.detokenizer is not None else ""
        if delta:
            end = state.detokenizer.streamable_length(finished) if state.detokenizer is not None else 0
            text_out = text[state.sent_text : end]
            tokens_out = state.token_ids[state.sent_tokens :]
            logprobs_out = state.logprobs[state.sent_tokens :] if state.logprobs is not None else None
            if not finished and not text_out and not tokens_out:
                return None
            state.sent_text, state.sent_tokens = max(end, state.sent_text), len(state.token_ids)
        else:
            text_out, tokens_out, logprobs_out = text, list(state.token_ids), state.logprobs
        completion = CompletionOutput(
            index=state.index,
            text=text_out,
            token_ids=tokens_out,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=logprobs_out,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
        )
