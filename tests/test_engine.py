"""The engine end to end on a tiny random Llama: sampling through the engine, scheduling invariance,
stop strings, n > 1, async scheduling, compilation, and bad input."""

from __future__ import annotations

import pytest

from tests.logprobs_check import close_logprobs
from tests.tiny_models import make_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.model.loader import ModelLoadError, load_model

PROMPTS = [[5, 6, 7], list(range(10, 50)), [9] * 7, [100, 3], list(range(60, 81)), [200] * 12]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_blocks=128)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "llama"
    make_tiny_checkpoint("LlamaForCausalLM", str(path))
    return load_model(str(path))


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, **ENGINE)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7, top_k=5, max_tokens=10, ignore_eos=True)] * 3
    batch = llm.generate(PROMPTS[:4], [others[0], params, others[1], others[2]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    unseeded = llm.generate([PROMPTS[1]] * 2, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True))
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_top_k_1_is_greedy(llm):
    top1 = SamplingParams(temperature=0.8, top_k=1, max_tokens=24, ignore_eos=True, seed=1)
    assert token_ids(llm.generate(PROMPTS, top1, use_tqdm=False)) == token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_logit_bias_and_penalties_act_through_the_engine(llm):
    forced = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8, logit_bias={77: 100.0}, ignore_eos=True))
    assert all(o.outputs[0].token_ids == [77] * 8 for o in forced)
    plain = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    penalised = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, presence_penalty=2.0,
                                                     ignore_eos=True), use_tqdm=False)
    repeats = lambda outs: sum(len(t) - len(set(t)) for t in token_ids(outs))  # noqa: E731
    assert repeats(plain) > 0, "the reference output should repeat itself for this test to mean anything"
    assert repeats(penalised) < repeats(plain)


def test_scheduling_does_not_change_greedy_output(tiny_model):
    reference = [token_ids(LLM(tiny_model, **ENGINE).generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS[:3]]
    configs = {
        "batched": ENGINE,
        "tiny token budget (chunked prefill)": {**ENGINE, "max_num_batched_tokens": 16},
        "prefix caching off": {**ENGINE, "enable_prefix_caching": False},
        "one step at a time": {**ENGINE, "async_scheduling": False},
        "KV cache small enough to preempt": {**ENGINE, "num_blocks": 20},
    }
    for name, kwargs in configs.items():
        engine = LLM(tiny_model, **kwargs)
        outputs = token_ids(engine.generate(PROMPTS[:3] * 2, GREEDY, use_tqdm=False))
        assert outputs == reference * 2, name
        if "preempt" in name:
            assert engine.engine.get_stats().num_preemptions > 0
        # a warm prefix-cache hit
        again = token_ids(engine.generate(PROMPTS[:3], GREEDY, use_tqdm=False))
        assert again == reference, f"{name}, second run"
        if kwargs.get("enable_prefix_caching", True) and "preempt" not in name:
            assert engine.engine.get_stats().prefix_cache_hits > 0


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_speculative_decoding_keeps_every_output(tiny_model, llm):
    """Requests verify n-gram proposals; a greedy request's output, a seeded sampled one's (each
    proposal kept when the row's own draw picks it), one with penalties, one with min_tokens and stop
    ids, and one with logprobs (and its logprobs) are what plain decoding gives, however the steps
    are cut."""
    sampled = SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True)
    penalised = SamplingParams(temperature=0.5, seed=9, max_tokens=24, ignore_eos=True, presence_penalty=0.4,
                               repetition_penalty=1.2)
    stopping = SamplingParams(temperature=0, max_tokens=24, min_tokens=3, stop_token_ids=[77, 200])
    with_logprobs = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    params = [GREEDY, sampled, penalised, stopping, with_logprobs, SamplingParams(temperature=0.9, seed=6, max_tokens=24)]
    reference = llm.generate(PROMPTS, params, use_tqdm=False)
    configs = {
        "batched": ENGINE,
        "tiny token budget (chunked prefill)": {**ENGINE, "max_num_batched_tokens": 16},
        "one step at a time": {**ENGINE, "async_scheduling": False},
        "KV cache small enough to preempt": {**ENGINE, "num_blocks": 20},
    }
    for name, kwargs in configs.items():
        engine = LLM(tiny_model, **kwargs, speculative_config=NGRAM)
        outputs = engine.generate(PROMPTS, params, use_tqdm=False)
        assert token_ids(outputs) == token_ids(reference), name
        ours, ref = outputs[4].outputs[0].logprobs, reference[4].outputs[0].logprobs
        assert len(ours) == len(ref) == 24 and close_logprobs(ours, ref), name
        stats = engine.engine.get_stats()
        assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens, name
        if "preempt" in name:
            assert stats.num_preemptions > 0


def test_stop_strings_cut_the_text(llm):
    text = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].outputs[0].text
    words = text.split()
    stop = words[5]
    cut = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True))[0]
    assert cut.outputs[0].text == text[: text.index(stop)]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    kept = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True,
                                                     include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_n_samples_with_a_seed_are_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    first = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    second = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) == 3


def test_nothing_compiles_after_warm_up(tiny_model, monkeypatch):
    monkeypatch.setenv("TOKENMILL_SKIP_PRECOMPILE", "0")
    monkeypatch.setenv("TOKENMILL_CHECK_RECOMPILATION", "1")
    engine = LLM(tiny_model, **{**ENGINE, "max_num_batched_tokens": 32})
    runner = engine.engine.runner
    # the buckets compile on a thread while the engine serves: a request right away is answered
    first = engine.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
    engine.engine.wait_precompiled()
    assert not engine.engine.precompiling()
    compiled = dict(runner._executables)
    assert len(compiled) == len(runner.token_buckets) * len(runner.block_buckets)
    mixed = [GREEDY, SamplingParams(temperature=0.9, max_tokens=30, ignore_eos=True)]
    for batch in ([PROMPTS[0]], PROMPTS, PROMPTS[:3] * 3):  # varied token counts, rows and contexts
        engine.generate(batch, [mixed[i % 2] for i in range(len(batch))], use_tqdm=False)
    assert runner._executables == compiled
    assert engine.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first.outputs[0].token_ids
    with pytest.raises(RuntimeError, match="recompilation after warm-up"):
        runner._executable(runner.token_buckets[0], runner.block_buckets[-1] + 1)


def test_bad_input_is_refused_with_a_clear_error(llm, tmp_path):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([list(range(4, 130))], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=500))
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate([[5, 10_000]], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(str(tmp_path), max_num_seqz=3)
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        LLM(str(tmp_path), speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="speculative_config.method"):
        LLM(str(tmp_path), speculative_config='{"method": "eagle"}')
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "missing"))
    # nothing was queued by the refused calls: the engine still serves
    assert token_ids(llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False))[0]
