"""The OpenAI-compatible request bodies (pydantic, strict types) and their SamplingParams.

Fields follow OpenAI's API, plus vLLM's extras (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, ...). Unknown fields are ignored, as vLLM does;
wrong types are a 400. Responses are built as plain dicts by completions.py and chat.py.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.sampling_params import SamplingParams


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Body):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams' convention)."""
        kw: dict[str, Any] = dict(
            n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            logit_bias=self.logit_bias, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        return SamplingParams(**kw)

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# ---- /v1/completions ----------------------------------------------------------------------------

PromptInput = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt; raises ValueError for an empty one."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif not p:
            raise ValueError("prompt must not be empty")
        elif isinstance(p[0], int):
            prompts = [p]
        else:
            prompts = list(p)
        for item in prompts:
            if len(item) == 0:
                raise ValueError("prompt must not be empty")
        return prompts

    def to_sampling_params(self) -> SamplingParams:
        self.check_stream_options()
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}) when given; got {self.best_of}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be in [0, 20] or None, got {self.logprobs}")
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)


# ---- /v1/chat/completions -----------------------------------------------------------------------


class ContentPart(_Body):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template_dict(self) -> dict:
        content = self.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"messages: content parts of type {part.type!r} are not supported (text only)")
                parts.append(part.text)
            text = "\n".join(parts)
        message = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    echo: bool = False

    def to_sampling_params(self) -> SamplingParams:
        self.check_stream_options()
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._sampling_params(max_tokens, logprobs)
        except ValueError as e:
            if str(e).startswith("logprobs"):
                raise ValueError("top_" + str(e)) from None
            raise

    def template_messages(self) -> list[dict]:
        return [message.to_template_dict() for message in self.messages]


# ---- /tokenize, /detokenize ---------------------------------------------------------------------


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
