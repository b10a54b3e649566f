"""Sampling parameters of one request: vLLM's names, defaults and validation rules.

Plain Python (no JAX): the API server builds and validates these. Every invalid value raises
`ValueError` whose message starts with the offending field's name, so the API layer can report
it as the OpenAI error's `param`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this mean greedy sampling (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Most top logprobs a request may ask for, per sampled token and per prompt token.
MAX_LOGPROBS = 20
# OpenAI's logit_bias range.
MAX_LOGIT_BIAS = 100.0


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Sampling parameters for text generation, following vLLM's `SamplingParams`.

    After construction: `stop` and `stop_token_ids` are lists, `top_k` is 0 when off (-1 is
    accepted and normalised), `seed=-1` means None, `logit_bias` has int keys, and greedy requests
    (temperature < 1e-5) have top_p/top_k/min_p reset to their "off" values, as vLLM does.
    """

    n: int = 1
    best_of: int | None = None  # accepted for compatibility, ignored
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    # Not an input: characters of output text held back while a stop string may be forming.
    output_text_buffer_length: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.seed == -1:
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = _normalise_logit_bias(self.logit_bias)

        self._verify_args()

        if self.temperature < SAMPLING_EPS:
            # Greedy: the filters do not apply (as vLLM).
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}")
        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1

    def _verify_args(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not (rp > 0.0 and math.isfinite(rp)):
            raise ValueError(f"repetition_penalty must be greater than zero, got {rp!r}")
        t = self.temperature
        if not _is_number(t) or not (t >= 0.0 and math.isfinite(t)):
            raise ValueError(f"temperature must be non-negative, got {t!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (off) or at least 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] or None, got {v!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must contain only non-negative integers, got {self.stop_token_ids}"
            )
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True")

    @property
    def sampling_type(self) -> SamplingType:
        return SamplingType.GREEDY if self.temperature < SAMPLING_EPS else SamplingType.RANDOM

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _normalise_logit_bias(bias: Any) -> dict[int, float]:
    """int (or decimal-string, as JSON objects carry them) keys; values in [-100, 100]."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id to bias, got {type(bias)}")
    out: dict[int, float] = {}
    for k, v in bias.items():
        if _is_int(k):
            tok = k
        elif isinstance(k, str) and k.strip().lstrip("-").isdigit():
            tok = int(k)
        else:
            raise ValueError(f"logit_bias keys must be integer token ids, got {k!r}")
        if tok < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {tok}")
        if not _is_number(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {v!r} for token {tok}")
        out[tok] = float(v)
    return out
