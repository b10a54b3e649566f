"""The engine end to end on the real SmolLM2-135M-Instruct: scheduling never changes greedy output."""

from __future__ import annotations

import os

import pytest

from tests.logprobs_check import close_logprobs
from tests.smaps import mapping_of, needs_thp, whole_pages
from tokenmill import LLM, SamplingParams
from tokenmill.model.loader import load_model

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful assistant. Answer briefly and precisely, in plain English. "
TOPICS = ["the moon", "bread", "rivers", "chess", "volcanoes", "owls", "glass", "jazz"]
PROMPTS = [SYSTEM + f"Question {i}: tell me one fact about {TOPICS[i % 8]}." + " Think." * (i % 5)
           for i in range(64)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = dict(max_model_len=256, max_num_seqs=64, max_num_batched_tokens=512, num_blocks=1200)


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load_model(smollm2_path)


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2, **ENGINE)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def alone(llm):
    """Greedy tokens of a few of the prompts, each run alone."""
    picks = [0, 9, 42, 63]
    return picks, {i: token_ids(llm.generate([PROMPTS[i]], GREEDY, use_tqdm=False))[0] for i in picks}


def check(outputs, alone):
    picks, expected = alone
    for i in picks:
        assert outputs[i] == expected[i], f"prompt {i}"


def test_alone_equals_inside_a_batch_of_64_and_warm_prefix_hits(llm, alone):
    llm.engine.reset_prefix_cache()
    cold = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    check(cold, alone)
    hits_before = llm.engine.get_stats().prefix_cache_hits
    warm = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert llm.engine.get_stats().prefix_cache_hits > hits_before
    assert warm == cold


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("prefix caching off", {"enable_prefix_caching": False}),
        ("tiny token budget: chunked prefill", {"max_num_batched_tokens": 32}),
        ("KV cache small enough to preempt", {"num_blocks": 40}),
        ("one step at a time (no async scheduling)", {"async_scheduling": False}),
        ("speculative decoding (n-gram proposals verified)",
         {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}}),
    ],
)
def test_scheduling_does_not_change_greedy_output(smollm2, alone, name, overrides):
    engine = LLM(smollm2, **{**ENGINE, **overrides})
    outputs = token_ids(engine.generate(PROMPTS[:16] + PROMPTS[40:], GREEDY, use_tqdm=False))
    picks, expected = alone
    by_index = dict(zip(list(range(16)) + list(range(40, 64)), outputs))
    for i in picks:
        assert by_index[i] == expected[i], f"{name}: prompt {i}"
    if "preempt" in name:
        assert engine.engine.get_stats().num_preemptions > 0
    if "speculative" in name:
        assert engine.engine.get_stats().num_accepted_tokens > 0


def test_speculative_sampling_keeps_seeded_outputs_and_logprobs(llm, smollm2):
    """Seeded sampled requests (one with a penalty, some with logprobs) speculate too: a proposal is
    kept when the row's own draw, with plain decoding's key for that step, picks it; the outputs and
    their logprobs are plain decoding's."""
    temperatures = (0.7, 0.3, 1.0, 0.5, 0.7, 0.2, 0.8, 0.6)
    params = [SamplingParams(temperature=t, seed=i, max_tokens=32, presence_penalty=0.3 * (i == 3),
                             logprobs=2 if i % 2 else None)
              for i, t in enumerate(temperatures)]
    plain = llm.generate(PROMPTS[:8], params, use_tqdm=False)
    spec = LLM(smollm2, **ENGINE, speculative_config={"num_speculative_tokens": 4, "prompt_lookup_min": 1})
    outputs = spec.generate(PROMPTS[:8], params, use_tqdm=False)
    assert token_ids(outputs) == token_ids(plain)
    for ours, ref in zip(outputs[1::2], plain[1::2]):  # to float32 rounding: a step of 5 rows is another XLA program
        assert len(ours.outputs[0].logprobs) == len(ours.outputs[0].token_ids)
        assert close_logprobs(ours.outputs[0].logprobs, ref.outputs[0].logprobs)
    assert spec.engine.get_stats().num_accepted_tokens > 0


def test_chat_uses_the_gguf_chat_template(llm, smollm2_path):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reference = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert llm.processor.render_chat(messages) == expected
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert out.prompt_token_ids == reference(expected, add_special_tokens=False).input_ids
    assert "Paris" in out.outputs[0].text


def test_stop_strings_and_seeded_samples(llm):
    text = llm.generate(["The colours of the rainbow are"], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text.split()[3]
    cut = llm.generate(["The colours of the rainbow are"], SamplingParams(temperature=0, max_tokens=12, stop=[stop]))[0]
    assert cut.outputs[0].text == text[: text.index(stop)] and cut.outputs[0].finish_reason == "stop"
    params = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=10)
    first = llm.generate(["Once upon a time"], params, use_tqdm=False)[0]
    second = llm.generate(["Once upon a time"], params, use_tqdm=False)[0]
    assert [o.text for o in first.outputs] == [o.text for o in second.outputs]
    assert len({o.text for o in first.outputs}) > 1


def test_last_layer_for_sampled_rows_only_changes_no_logprob(llm):
    """A step that only samples runs the last layer past its KV write for each request's last row; one
    where a request wants its prompt's logprobs runs it for every row. The sampled tokens' logprobs
    must be the same bits either way (in a batch with chunked, decoding and prefilling requests)."""
    prompts = PROMPTS[:6]
    params = dict(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    llm.engine.reset_prefix_cache()
    sampled_rows_only = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
    llm.engine.reset_prefix_cache()
    every_row = llm.generate(prompts, SamplingParams(**params, prompt_logprobs=1), use_tqdm=False)
    assert all(o.prompt_logprobs for o in every_row)
    for a, b in zip(sampled_rows_only, every_row):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_greedy_head_gives_the_float32_heads_tokens(llm, alone):
    """A lone greedy request without logprobs takes the screened LM head (ops/cpu/greedy_head), one that
    asks for logprobs the full float32 head: the same tokens, and the argmax is the logprobs' top token."""
    assert "lm_head_screen" in llm.engine.runner.params
    picks, expected = alone
    for i in picks:
        out = llm.generate([PROMPTS[i]], SamplingParams(temperature=0.0, max_tokens=len(expected[i]),
                                                         ignore_eos=True, logprobs=1), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == expected[i], f"prompt {i}"
        for token, lp in zip(out.token_ids, out.logprobs):
            assert max(lp.items(), key=lambda kv: kv[1].logprob)[0] == token


@needs_thp
def test_weights_end_on_huge_pages(llm):
    """Once the engine has compiled its buckets, its float32 projections lie on 2 MiB pages
    (worker/huge_pages.py), where a decode step streams them faster."""
    llm.engine.wait_precompiled()
    first, length = whole_pages(llm.engine.runner.params["layers"]["w_gate_up"])
    assert length > 0 and mapping_of(first)["AnonHugePages"] >= length
