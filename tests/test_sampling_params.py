"""SamplingParams: vLLM's defaults, normalisation and validation."""

from __future__ import annotations

import pytest

from tokenmill.ops.sampler import MAX_LOGPROBS as SAMPLER_MAX_LOGPROBS
from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingType

# vLLM's SamplingParams defaults (after __post_init__).
VLLM_DEFAULTS = dict(
    n=1,
    best_of=None,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    repetition_penalty=1.0,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    min_p=0.0,
    seed=None,
    stop=[],
    stop_token_ids=[],
    ignore_eos=False,
    max_tokens=16,
    min_tokens=0,
    logprobs=None,
    prompt_logprobs=None,
    detokenize=True,
    skip_special_tokens=True,
    spaces_between_special_tokens=True,
    include_stop_str_in_output=False,
    logit_bias=None,
)


def test_defaults_equal_vllm():
    p = SamplingParams()
    for name, value in VLLM_DEFAULTS.items():
        assert getattr(p, name) == value, name
    assert p.sampling_type == SamplingType.RANDOM
    assert not p.uses_penalties
    assert MAX_LOGPROBS == SAMPLER_MAX_LOGPROBS == 20


def test_normalisation():
    p = SamplingParams(top_k=-1, stop="###", seed=-1, stop_token_ids=(3, 4),
                       logit_bias={"17": 5, 3: -100.0}, max_tokens=None)
    assert p.top_k == 0
    assert p.stop == ["###"] and p.stop_token_ids == [3, 4]
    assert p.seed is None
    assert p.logit_bias == {17: 5.0, 3: -100.0}
    assert p.max_tokens is None
    assert p.output_text_buffer_length == 2
    assert SamplingParams(stop=["a", "abcd"], include_stop_str_in_output=True
                          ).output_text_buffer_length == 0


def test_greedy():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.2)
    assert p.sampling_type == SamplingType.GREEDY
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)  # filters do not apply to greedy
    assert SamplingParams(temperature=1e-6).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-4).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, presence_penalty=0.1).uses_penalties


def test_valid_edges():
    SamplingParams(n=4, top_p=1.0, top_k=1, min_p=1.0, presence_penalty=-2.0,
                   frequency_penalty=2.0, repetition_penalty=0.01, max_tokens=1,
                   min_tokens=1, logprobs=0, prompt_logprobs=MAX_LOGPROBS, seed=0,
                   logit_bias={0: 100.0, 1: -100.0})
    SamplingParams(seed=2**40, min_tokens=1000, max_tokens=None)
    SamplingParams(best_of=0)  # accepted and ignored


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "n"),
        (dict(n=1.5), "n"),
        (dict(n=2, temperature=0.0), "n"),  # greedy with n > 1, as vLLM
        (dict(temperature=-1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(presence_penalty=-2.1), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(frequency_penalty=2.01), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-5), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=17), "min_tokens"),  # > max_tokens=16
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(logit_bias={1: 100.5}), "logit_bias"),
        (dict(logit_bias={1: -101}), "logit_bias"),
        (dict(logit_bias={"abc": 1.0}), "logit_bias"),
        (dict(logit_bias={1.5: 1.0}), "logit_bias"),
        (dict(logit_bias={-3: 1.0}), "logit_bias"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
        (dict(seed=1.5), "seed"),
        (dict(seed="7"), "seed"),
        (dict(stop=""), "stop"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(stop=[3]), "stop"),
        (dict(stop="x", detokenize=False), "stop"),
        (dict(stop_token_ids=[1, "2"]), "stop_token_ids"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    assert str(exc.value).startswith(field + " "), str(exc.value)
