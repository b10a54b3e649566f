"""Scheduler: token budget, chunked prefill, preemption, prefix caching, finishing, speculative
decoding — with a fake runner.

The fake runner keeps its own persistent batch, as the real one does, and a fake KV cache: every
slot written holds a key of the whole prefix up to its position. Before sampling, it checks that
every position of the request's context reads back the right key through the block table, so any
block mix-up (a wrong prefix hit, a block freed while in use, a lost block id, a rejected
proposal's slot taken as computed) fails the test.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import RequestUpdate, Scheduler
from tokenmill.core.step_io import Logprobs, ModelRunnerOutput, SchedulerOutput
from tokenmill.sampling_params import SamplingParams

V = 1000
EOS = 999


def next_token(tokens: list[int]) -> int:
    """Depends only on the request's own tokens; never EOS."""
    return (sum(tokens) * 7 + len(tokens) * 13) % (V - 1)


class _Row:
    def __init__(self, token_ids, num_prompt, num_computed, block_ids):
        self.tokens = list(token_ids)
        self.num_prompt = num_prompt
        self.computed = num_computed
        self.blocks = list(block_ids)
        self.keys: list[int] = []

    def key(self, pos: int, drafts=()) -> int:
        """The key of the prefix up to `pos`, of the known tokens followed by `drafts`."""
        n = len(self.tokens)
        if pos >= n:
            k = self.key(n - 1)
            for t in drafts[: pos - n + 1]:
                k = hash((k, t))
            return k
        while len(self.keys) <= pos:
            i = len(self.keys)
            self.keys.append(hash((self.keys[-1] if self.keys else -1, self.tokens[i])))
        return self.keys[pos]


class FakeRunner:
    def __init__(self, block_size: int, num_blocks: int, token_fn=None, prompt_logprobs=False, max_rows=8):
        self.max_rows = max_rows
        self.bs = block_size
        self.num_blocks = num_blocks
        self.token_fn = token_fn or (lambda rid, tokens: next_token(tokens))
        self.prompt_logprobs = prompt_logprobs
        self.rows: dict[str, _Row] = {}
        self.kv: dict[int, int] = {}

    def slot(self, row: _Row, pos: int) -> int:
        b = row.blocks[pos // self.bs]
        assert 0 < b < self.num_blocks
        return b * self.bs + pos % self.bs

    def __call__(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.rows.pop(rid, None)
        for new in so.new_requests:
            assert new.req_id not in self.rows
            self.rows[new.req_id] = _Row(new.token_ids, new.num_prompt_tokens, new.num_computed_tokens, new.block_ids)
        for c in so.cached_requests:
            self.rows[c.req_id].blocks += c.new_block_ids
        assert len(self.rows) <= self.max_rows, "more requests than the batch has rows"
        out = ModelRunnerOutput(sampled_token_ids={})
        # write every request's KV first, then read (the real runner does so per layer)
        spans = {}
        for rid, n in so.num_scheduled_tokens.items():
            row = self.rows[rid]
            drafts = so.spec_token_ids.get(rid, [])
            start, end = row.computed, row.computed + n
            assert n > 0 and end <= len(row.tokens) + len(drafts), (rid, start, n, len(row.tokens))
            assert not drafts or end == len(row.tokens) + len(drafts), "proposals follow the last known token"
            assert end <= len(row.blocks) * self.bs, "scheduled tokens beyond the allocated blocks"
            for pos in range(start, end):
                self.kv[self.slot(row, pos)] = row.key(pos, drafts)
            row.computed = end
            spans[rid] = (start, end)
        for rid, (start, end) in spans.items():
            row = self.rows[rid]
            drafts = so.spec_token_ids.get(rid, [])
            for pos in range(end):
                assert self.kv.get(self.slot(row, pos)) == row.key(pos, drafts), f"{rid}: bad KV at position {pos}"
            if self.prompt_logprobs and start < row.num_prompt - 1:
                last = min(end, row.num_prompt - 1)
                out.prompt_logprobs[rid] = [Logprobs([row.tokens[p + 1]], [0.0], 1) for p in range(start, last)]
            if end == len(row.tokens) + len(drafts):
                # the model's picks, kept while each equals its proposal (greedy verification)
                toks = [self.token_fn(rid, row.tokens)]
                for proposed in drafts:
                    if toks[-1] != proposed:
                        break
                    toks.append(self.token_fn(rid, row.tokens + toks))
                row.computed -= len(drafts) - (len(toks) - 1)
                row.tokens += toks
                out.sampled_token_ids[rid] = toks[0]
                if len(toks) > 1:
                    out.spec_token_ids[rid] = toks[1:]
        return out


def make_sched(num_blocks=64, block_size=4, budget=32, seqs=8, max_model_len=256, caching=True, policy="fcfs",
               spec: SpeculativeConfig | None = None):
    return Scheduler(
        SchedulerConfig(max_model_len=max_model_len, max_num_seqs=seqs, max_num_batched_tokens=budget),
        CacheConfig(block_size=block_size),
        num_blocks,
        enable_prefix_caching=caching,
        policy=policy,
        speculative_config=spec,
    )


_arrival = itertools.count()


def make_req(rid, prompt, max_tokens=8, eos=(), priority=0, **sp) -> Request:
    return Request(
        rid,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, temperature=0.0, **sp),
        eos_token_ids=eos,
        arrival_time=float(next(_arrival)),
        seed=0,
        priority=priority,
    )


def check_step(sched: Scheduler, so: SchedulerOutput, runner: FakeRunner | None = None) -> None:
    assert so.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(so.num_scheduled_tokens) <= sched.max_num_seqs
    # every request's last token and every proposal is a logits row: within max_num_seqs rows
    assert len(so.num_scheduled_tokens) + sum(map(len, so.spec_token_ids.values())) <= sched.max_num_seqs
    assert len(sched.running) <= sched.max_num_seqs
    if runner is not None:
        assert len(runner.rows) <= sched.max_num_seqs
    # batch order: running (cached) first, then new
    order = list(so.num_scheduled_tokens)
    expected = [c.req_id for c in so.cached_requests] + [n.req_id for n in so.new_requests]
    assert order == expected


def step(sched, runner, updates=None):
    so = sched.schedule()
    check_step(sched, so, runner)
    ups = sched.update_from_output(so, runner(so))
    if updates is not None:
        for u in ups:
            updates[u.req_id].append(u)
    return so, ups


def run_all(sched: Scheduler, runner: FakeRunner, max_steps=10_000):
    """Steps until nothing is left; returns ({id: output tokens}, {id: final update}, steps)."""
    outputs: dict[str, list[int]] = defaultdict(list)
    final: dict[str, RequestUpdate] = {}
    steps = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        check_step(sched, so, runner)
        assert so.total_num_scheduled_tokens > 0, "a step with nothing to do while requests wait"
        for u in sched.update_from_output(so, runner(so)):
            outputs[u.req_id] += u.new_token_ids
            if u.finished:
                final[u.req_id] = u
        for r in sched.running:  # the runner's view of each request matches the scheduler's
            if r.request_id in runner.rows:
                assert runner.rows[r.request_id].tokens == r.all_token_ids
                assert runner.rows[r.request_id].computed == r.num_computed_tokens
        sched.kv.check_consistency()
        steps += 1
        assert steps < max_steps
    # the runner is told to drop the last finished requests on the next schedule
    runner(sched.schedule())
    assert not runner.rows
    return dict(outputs), final, steps


# ---- budget, seats, chunking ----------------------------------------------------------------------


def test_budget_and_max_num_seqs_respected():
    sched = make_sched(budget=16, seqs=3)
    runner = FakeRunner(4, 64, max_rows=3)
    for i in range(7):
        sched.add_request(make_req(f"r{i}", range(i, i + 5 + i), max_tokens=4))
    outputs, final, _ = run_all(sched, runner)
    assert len(final) == 7
    assert all(len(outputs[f"r{i}"]) == 4 for i in range(7))
    assert all(u.finish_reason == "length" for u in final.values())


def test_long_prompt_is_chunked():
    sched = make_sched(budget=32, block_size=4, max_model_len=256)
    runner = FakeRunner(4, 64)
    sched.add_request(make_req("long", range(100), max_tokens=2))
    counts = []
    for _ in range(4):
        so, ups = step(sched, runner)
        counts.append(so.num_scheduled_tokens["long"])
        assert bool(ups) == (len(counts) == 4)  # a token only after the last chunk
    assert counts == [32, 32, 32, 4]
    assert sched.requests["long"].num_output_tokens == 1


def test_decodes_keep_flowing_while_a_long_prompt_prefills():
    sched = make_sched(budget=16, block_size=4, max_model_len=512, num_blocks=128)
    runner = FakeRunner(4, 128)
    sched.add_request(make_req("dec", range(5), max_tokens=50))
    step(sched, runner)  # prefill of "dec"
    sched.add_request(make_req("long", range(200), max_tokens=1))
    chunks = 0
    while "long" in sched.requests:
        before = sched.requests["dec"].num_output_tokens
        so, _ = step(sched, runner)
        assert so.num_scheduled_tokens["dec"] == 1
        assert sched.requests["dec"].num_output_tokens == before + 1
        if "long" in so.num_scheduled_tokens:
            assert so.num_scheduled_tokens["long"] <= 15
            chunks += 1
    assert chunks == -(-200 // 15)


# ---- preemption -----------------------------------------------------------------------------------


def _workload(n=8):
    return [make_req(f"r{i}", [i + 1] * (6 + 3 * i), max_tokens=20 + i) for i in range(n)]


def test_preemption_then_resume_gives_the_same_outputs():
    big = make_sched(num_blocks=256, budget=64, seqs=8, caching=False)
    for r in _workload():
        big.add_request(r)
    ref, ref_final, _ = run_all(big, FakeRunner(4, 256))
    assert big.num_preemptions == 0

    for caching in (False, True):
        tiny = make_sched(num_blocks=20, budget=64, seqs=8, caching=caching)  # 19 usable blocks
        for r in _workload():
            tiny.add_request(r)
        out, final, _ = run_all(tiny, FakeRunner(4, 20))
        assert tiny.num_preemptions > 0
        assert tiny.get_stats().num_preemptions == tiny.num_preemptions
        assert out == ref
        assert {k: u.finish_reason for k, u in final.items()} == {k: u.finish_reason for k, u in ref_final.items()}
        assert tiny.kv.num_free_blocks == 19 and tiny.kv.usage == 0.0


def test_preempted_request_resumes_with_its_outputs():
    sched = make_sched(num_blocks=6, block_size=4, budget=64, caching=False)  # 5 usable blocks
    runner = FakeRunner(4, 6)
    a = make_req("a", range(1, 7), max_tokens=12)  # 6 + 12 - 1 = 17 tokens: 5 blocks
    b = make_req("b", range(10, 16), max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    preempted_seen = False
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        so, _ = step(sched, runner)
        if "b" in so.finished_req_ids and "b" in sched.requests:
            preempted_seen = True
            assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
            assert sched.waiting.peek() is b
            assert b.num_output_tokens > 0
        resumed = [n for n in so.new_requests if n.req_id == "b" and b.num_preemptions]
        for n in resumed:
            assert n.token_ids[: n.num_prompt_tokens] == b.prompt_token_ids
            assert len(n.token_ids) > n.num_prompt_tokens  # outputs so far ride along
    assert preempted_seen and b.num_preemptions >= 1
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12


# ---- abort ----------------------------------------------------------------------------------------


def test_abort_frees_blocks_in_the_same_call():
    sched = make_sched(num_blocks=32)
    runner = FakeRunner(4, 32)
    sched.add_request(make_req("a", range(20), max_tokens=50))
    sched.add_request(make_req("w", range(20), max_tokens=50))
    step(sched, runner)
    assert sched.kv.num_free_blocks < 31
    assert sched.finish_requests(["a", "w", "unknown"]) == ["a", "w"]
    assert sched.kv.num_free_blocks == 31 and sched.kv.usage == 0.0
    assert not sched.has_unfinished_requests()
    so = sched.schedule()
    assert so.finished_req_ids == {"a", "w"}  # both were in the runner: it drops them
    runner(so)
    assert not runner.rows


def test_abort_of_a_waiting_request_and_of_one_in_flight():
    sched = make_sched(num_blocks=32, seqs=1)
    runner = FakeRunner(4, 32)
    sched.add_request(make_req("a", range(8)))
    sched.add_request(make_req("b", range(8)))
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["a"]
    sched.finish_requests("b")  # waiting: not sent to the runner
    sched.finish_requests("a")  # its step is in flight: its output is ignored
    assert sched.update_from_output(so, runner(so)) == []
    assert sched.schedule().finished_req_ids == {"a"}
    assert sched.kv.num_free_blocks == 31


# ---- prefix caching -------------------------------------------------------------------------------


def test_prefix_hit_counted_and_results_unchanged():
    sched = make_sched(block_size=4)
    runner = FakeRunner(4, 64)
    prompt = list(range(50, 63))  # 13 tokens: 3 full blocks + 1
    sched.add_request(make_req("a", prompt, max_tokens=5))
    out_a, _, _ = run_all(sched, runner)
    sched.add_request(make_req("b", prompt, max_tokens=5))
    so = sched.schedule()
    (new,) = so.new_requests
    assert new.num_computed_tokens == 12 and so.num_scheduled_tokens["b"] == 1
    first = [t for u in sched.update_from_output(so, runner(so)) for t in u.new_token_ids]
    out_b, final, _ = run_all(sched, runner)
    assert first + out_b["b"] == out_a["a"]  # the hit changes nothing
    assert final["b"].num_cached_tokens == 12
    stats = sched.get_stats()
    assert stats.prefix_cache_queries == 26 and stats.prefix_cache_hits == 12
    assert stats.prefix_cache_hit_rate == pytest.approx(12 / 26)


def test_prefix_hits_give_identical_outputs():
    prompts = {f"r{i}": [7] * 9 + [i] * (3 + i) for i in range(6)}  # a shared 8-token prefix and more
    outs = {}
    for caching in (False, True):
        sched = make_sched(block_size=4, budget=8, caching=caching)
        for rid, p in prompts.items():
            sched.add_request(make_req(rid, p, max_tokens=10))
        outs[caching], _, _ = run_all(sched, FakeRunner(4, 64))
        if caching:
            assert sched.kv.prefix_cache_hits > 0
    assert outs[True] == outs[False]


def test_whole_cached_sequence_recomputes_its_last_token():
    sched = make_sched(block_size=4)
    runner = FakeRunner(4, 64)
    sched.add_request(make_req("a", range(12), max_tokens=1))
    run_all(sched, runner)
    sched.add_request(make_req("b", range(12), max_tokens=1))
    so = sched.schedule()
    assert so.new_requests[0].num_computed_tokens == 8
    assert so.num_scheduled_tokens["b"] == 4


def test_generated_tokens_become_cached():
    sched = make_sched(block_size=4)
    runner = FakeRunner(4, 64)
    sched.add_request(make_req("a", range(5), max_tokens=12))
    out, _, _ = run_all(sched, runner)
    full = list(range(5)) + out["a"]  # 17 tokens; 16 computed (the last one was only sampled)
    sched.add_request(make_req("b", full + [1, 2], max_tokens=1))
    so = sched.schedule()
    assert so.new_requests[0].num_computed_tokens == 16


def test_finished_blocks_stay_cached_then_lru_evicted():
    sched = make_sched(num_blocks=9, block_size=4, budget=64)  # 8 usable blocks
    runner = FakeRunner(4, 9)
    sched.add_request(make_req("old", [1] * 8 + [9], max_tokens=1))  # keys 2 blocks
    run_all(sched, runner)
    sched.add_request(make_req("new", [2] * 8 + [9], max_tokens=1))
    run_all(sched, runner)
    assert sched.kv.num_free_blocks == 8 and sched.kv.num_cached_blocks == 4
    # needs 5 blocks: the 4 unkeyed ones go first (never-used and partial blocks), then the least
    # recently used keyed one: "old"'s tail (freed before its head)
    sched.add_request(make_req("big", range(100, 120), max_tokens=1))
    so = sched.schedule()
    assert so.new_requests[0].num_computed_tokens == 0
    assert sched.kv.get_computed_blocks(make_req("p1", [1] * 8 + [9]))[1] == 4
    assert sched.kv.get_computed_blocks(make_req("p2", [2] * 8 + [9]))[1] == 8
    sched.update_from_output(so, runner(so))
    run_all(sched, runner)
    # 2 more blocks: "old"'s head goes next, then "new"'s tail
    sched.add_request(make_req("more", range(200, 208), max_tokens=1))
    sched.schedule()
    assert sched.kv.get_computed_blocks(make_req("p3", [1] * 8 + [9]))[1] == 0
    assert sched.kv.get_computed_blocks(make_req("p4", [2] * 8 + [9]))[1] == 4


def test_reset_prefix_cache():
    sched = make_sched()
    runner = FakeRunner(4, 64)
    sched.add_request(make_req("a", range(13), max_tokens=3))
    step(sched, runner)
    assert sched.reset_prefix_cache() is False
    run_all(sched, runner)
    assert sched.reset_prefix_cache() is True
    sched.add_request(make_req("b", range(13), max_tokens=3))
    so = sched.schedule()
    assert so.new_requests[0].num_computed_tokens == 0


# ---- admission ------------------------------------------------------------------------------------


def test_refuses_requests_that_can_never_fit():
    sched = make_sched(num_blocks=5, block_size=4, max_model_len=64)  # 4 usable blocks: 16 slots
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_req("a", range(60), max_tokens=5))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_req("b", range(64), max_tokens=None))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(make_req("c", range(10), max_tokens=8))  # 17 slots
    sched.add_request(make_req("d", range(10), max_tokens=7))  # 16 slots: fits exactly
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_req("d", range(3)))
    assert not sched.waiting.peek().is_finished
    out, final, _ = run_all(sched, FakeRunner(4, 5))
    assert len(out["d"]) == 7


def test_max_tokens_none_runs_to_max_model_len():
    sched = make_sched(max_model_len=20)
    sched.add_request(make_req("a", range(5), max_tokens=None))
    out, final, _ = run_all(sched, FakeRunner(4, 64))
    assert len(out["a"]) == 15 and final["a"].finish_reason == "length"


# ---- finishing ------------------------------------------------------------------------------------


def scripted(tokens_by_req):
    """A runner token function that plays back a fixed output per request."""
    return lambda rid, toks: tokens_by_req[rid][len(toks) - PROMPT_LEN]


PROMPT_LEN = 3


@pytest.mark.parametrize(
    "script, kw, expected, reason, stop_reason",
    [
        ([5, 6, EOS, 7, 8], {}, [5, 6, EOS], "stop", None),
        ([5, 6, EOS, 7, 8], {"ignore_eos": True}, [5, 6, EOS, 7, 8], "length", None),
        ([5, EOS, 6, EOS, 8], {"min_tokens": 3}, [5, EOS, 6, EOS], "stop", None),
        ([5, 42, 6, 7, 8], {"stop_token_ids": [42]}, [5, 42], "stop", 42),
        ([42, 5, 42, 7, 8], {"stop_token_ids": [42], "min_tokens": 2}, [42, 5, 42], "stop", 42),
        ([5, 6, 7, 8, 9], {}, [5, 6, 7, 8, 9], "length", None),
        ([5, 6, 7, 8, EOS], {}, [5, 6, 7, 8, EOS], "stop", None),  # EOS as the last allowed token
    ],
)
def test_finishing(script, kw, expected, reason, stop_reason):
    sched = make_sched()
    sched.add_request(make_req("a", range(PROMPT_LEN), max_tokens=5, eos=(EOS,), **kw))
    out, final, _ = run_all(sched, FakeRunner(4, 64, token_fn=scripted({"a": script})))
    assert out["a"] == expected
    assert final["a"].finished and final["a"].finish_reason == reason
    assert final["a"].stop_reason == stop_reason


def test_max_model_len_caps_even_before_min_tokens():
    sched = make_sched(max_model_len=8)
    sched.add_request(make_req("a", range(PROMPT_LEN), max_tokens=None, eos=(EOS,), min_tokens=10))
    out, final, _ = run_all(sched, FakeRunner(4, 64, token_fn=scripted({"a": [EOS] * 5})))
    assert out["a"] == [EOS] * 5 and final["a"].finish_reason == "length"


# ---- scheduling details ---------------------------------------------------------------------------


def test_schedule_runs_ahead_of_output():
    """schedule() before the previous step's output is back: prefill chunks go on, and a request
    whose sampled token is still in flight decodes at that position (a placeholder the runner
    fills on device), but never past its max_tokens."""
    sched = make_sched(budget=8)
    runner = FakeRunner(4, 64)
    sched.add_request(make_req("a", range(20), max_tokens=3))
    so1 = sched.schedule()
    so2 = sched.schedule()
    assert so1.num_scheduled_tokens == {"a": 8} and so2.num_scheduled_tokens == {"a": 8}
    sched.update_from_output(so1, runner(so1))
    sched.update_from_output(so2, runner(so2))
    so3 = sched.schedule()  # the last prompt chunk: samples output token 1
    so4 = sched.schedule()  # decodes at token 1's position while it is in flight: samples token 2
    assert so3.num_scheduled_tokens == {"a": 4} and so4.num_scheduled_tokens == {"a": 1}
    ups = sched.update_from_output(so3, runner(so3))
    assert len(ups) == 1 and len(ups[0].new_token_ids) == 1
    so5 = sched.schedule()  # samples token 3, the last allowed
    so6 = sched.schedule()  # max_tokens reached counting the steps in flight: nothing
    assert so5.num_scheduled_tokens == {"a": 1} and so6.num_scheduled_tokens == {}
    sched.update_from_output(so4, runner(so4))
    ups = sched.update_from_output(so5, runner(so5))
    assert ups[0].finished and ups[0].finish_reason == "length"
    assert not sched.has_unfinished_requests()


def test_priority_policy():
    sched = make_sched(seqs=1, policy="priority")
    runner = FakeRunner(4, 64)
    sched.add_request(make_req("low", range(4), max_tokens=2, priority=5))
    sched.add_request(make_req("high", range(4), max_tokens=2, priority=-1))
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["high"]
    sched.update_from_output(so, runner(so))
    out, _, _ = run_all(sched, runner)
    assert len(out["low"]) == 2


def test_priority_preempts_the_lowest_priority():
    sched = make_sched(num_blocks=7, budget=64, policy="priority", caching=False)  # 6 usable blocks
    runner = FakeRunner(4, 7)
    sched.add_request(make_req("mid", [1] * 4, max_tokens=9, priority=1))
    sched.add_request(make_req("low", [2] * 4, max_tokens=9, priority=2))
    sched.add_request(make_req("high", [3] * 4, max_tokens=9, priority=0))
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["high", "mid", "low"]
    assert [r.request_id for r in sched.running] == ["high", "mid", "low"]
    sched.update_from_output(so, runner(so))
    victims = []
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        so, _ = step(sched, runner)
        victims += [rid for rid in so.finished_req_ids if rid in sched.requests]
    assert victims and victims[0] == "low"


def test_prompt_logprobs_not_repeated_after_preemption():
    sched = make_sched(num_blocks=6, block_size=4, budget=64, caching=True)  # 5 usable blocks
    runner = FakeRunner(4, 6, prompt_logprobs=True)
    sched.add_request(make_req("a", range(1, 7), max_tokens=12, prompt_logprobs=1))
    sched.add_request(make_req("b", range(10, 16), max_tokens=12, prompt_logprobs=1))
    got = defaultdict(list)
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        _, ups = step(sched, runner)
        for u in ups:
            got[u.req_id] += u.prompt_logprobs or []
    assert sched.num_preemptions > 0
    for rid, prompt in (("a", range(1, 7)), ("b", range(10, 16))):
        assert [lp.token_ids[0] for lp in got[rid]] == list(prompt)[1:]


def test_stats():
    sched = make_sched()
    runner = FakeRunner(4, 64)
    sched.add_request(make_req("a", range(10)))
    sched.add_request(make_req("b", range(10)))
    step(sched, runner)
    s = sched.get_stats()
    assert s.num_running == 2 and s.num_waiting == 0
    assert 0 < s.kv_cache_usage < 1
    assert s.schedule_time_us > 0
    assert s.prefix_cache_queries == 20


# ---- speculative decoding ---------------------------------------------------------------------------

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)


def loop_with_breaks(rid, toks):
    """Repeats the token 4 back (n-gram proposals mostly right), except every 9th position."""
    return next_token(toks) if len(toks) % 9 == 0 else toks[-4]


def test_speculation_gives_the_same_outputs_and_rolls_back_rejected_proposals():
    prompts = {f"r{i}": [i + 1, i + 2, i + 3, i + 4] * 3 + [i] * i for i in range(6)}
    results = {}
    for spec in (None, NGRAM):
        sched = make_sched(budget=16, seqs=4, spec=spec)
        for rid, p in prompts.items():
            sched.add_request(make_req(rid, p, max_tokens=20 + len(p)))
        results[spec is not None] = run_all(sched, FakeRunner(4, 64, token_fn=loop_with_breaks, max_rows=4))
        stats = sched.get_stats()
    (plain, plain_final, plain_steps), (spec_out, spec_final, spec_steps) = results[False], results[True]
    assert spec_out == plain
    assert {r: u.finish_reason for r, u in spec_final.items()} == {r: "length" for r in prompts}
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some proposals rejected (and rolled back)
    assert spec_steps < plain_steps


@pytest.mark.parametrize(
    "script, kw, expected, reason",
    [
        ([3, 1, 2, 3, EOS, 2, 3, 1], {}, [3, 1, 2, 3, EOS], "stop"),  # EOS among verified tokens
        ([3, 1, 2, 3, 1, 2, 3, 1], {"stop_token_ids": [2]}, [3, 1, 2], "stop"),
        ([3, 1, 2, 3, 1, 2, 3, 1], {}, [3, 1, 2, 3, 1, 2, 3], "length"),  # max_tokens=7 mid-proposal
    ],
)
def test_speculation_stops_where_plain_decoding_does(script, kw, expected, reason):
    sched = make_sched(spec=NGRAM)
    sched.add_request(make_req("a", [1, 2, 3, 1, 2], max_tokens=7, eos=(EOS,), **kw))
    out, final, _ = run_all(sched, FakeRunner(4, 64, token_fn=lambda rid, toks: script[len(toks) - 5]))
    assert out["a"] == expected and final["a"].finish_reason == reason
    assert sched.get_stats().num_accepted_tokens > 0


def test_speculation_stays_within_max_model_len_and_its_blocks():
    """Proposals never reach past max_model_len, nor past the KV blocks add_request checked."""
    sched = make_sched(num_blocks=4, max_model_len=12, spec=NGRAM)  # 3 usable blocks: 12 slots
    sched.add_request(make_req("a", [7, 8, 7, 8], max_tokens=None))
    out, final, _ = run_all(sched, FakeRunner(4, 4, token_fn=lambda rid, toks: toks[-2]))
    assert out["a"] == [7, 8] * 4 and final["a"].finish_reason == "length"
    assert sched.get_stats().num_accepted_tokens > 0


def test_proposals_never_cost_a_preemption():
    """Step 2: a's proposals would need the block b holds; a decodes its one token instead."""
    sched = make_sched(num_blocks=4, spec=NGRAM)  # 3 usable blocks of 4
    sched.add_request(make_req("a", [1, 2, 1, 2, 1, 2, 1], max_tokens=5))
    sched.add_request(make_req("b", [5, 6, 7], max_tokens=2))
    runner = FakeRunner(4, 4, token_fn=lambda rid, toks: toks[-2])
    updates = defaultdict(list)
    step(sched, runner, updates)
    so, _ = step(sched, runner, updates)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1} and not so.spec_token_ids
    out, _, _ = run_all(sched, runner)
    assert [t for u in updates["a"] for t in u.new_token_ids] + out["a"] == [2, 1, 2, 1, 2]
    assert sched.num_preemptions == 0
    assert sched.get_stats().num_accepted_tokens > 0


def test_proposals_share_the_logits_rows_of_max_num_seqs():
    """Every scheduled request's last token and every proposal is a logits row: 6 rows, 4 requests."""
    sched = make_sched(seqs=6, spec=NGRAM)
    for rid in "abcd":
        sched.add_request(make_req(rid, [1, 2, 1, 2, 1, 2], max_tokens=8))
    runner = FakeRunner(4, 64, token_fn=lambda rid, toks: toks[-2])
    step(sched, runner)
    so, _ = step(sched, runner)
    assert so.spec_token_ids == {"a": [2, 1]} and len(so.num_scheduled_tokens) == 4


# ---- property: random events keep the pool consistent ----------------------------------------------

MAX_LEN, NUM_BLOCKS, BS = 36, 10, 4  # 9 usable blocks: 36 slots, so preemption is frequent


class Driver:
    """Random adds, aborts and steps (in step, one step ahead, or with an abort while in flight)."""

    def __init__(self, caching: bool, policy: str, spec: SpeculativeConfig | None = None):
        self.sched = make_sched(num_blocks=NUM_BLOCKS, block_size=BS, budget=16, seqs=4,
                                max_model_len=MAX_LEN, caching=caching, policy=policy, spec=spec)
        self.runner = FakeRunner(BS, NUM_BLOCKS, token_fn=lambda rid, toks: (sum(toks) + len(toks)) % 7, max_rows=4)
        self.serial = 0
        self.finished = 0

    def update(self, so):
        for u in self.sched.update_from_output(so, self.runner(so)):
            self.finished += u.finished
        self.check()

    def check(self):
        kv = self.sched.kv
        kv.check_consistency()
        assert all(c >= 0 for c in kv.ref_cnt)
        assert len(self.sched.running) + len(self.sched.waiting) == len(self.sched.requests)

    def apply(self, ev):
        sched = self.sched
        if ev[0] == "add":
            _, plen, max_tokens, variant = ev
            self.serial += 1
            r = make_req(f"r{self.serial}", [variant] * plen, max_tokens=max_tokens, eos=(6,),
                         priority=self.serial % 3, min_tokens=self.serial % 2)
            try:
                sched.add_request(r)
            except ValueError:
                assert plen + max_tokens > MAX_LEN
        elif ev[0] == "abort":
            sched.finish_requests(f"r{ev[1]}")
            self.check()
        else:
            _, mode, victim = ev
            busy = sched.has_unfinished_requests()
            so = sched.schedule()
            check_step(sched, so, self.runner)
            assert so.total_num_scheduled_tokens > 0 or not busy, "stalled"
            if mode == "ahead":
                so2 = sched.schedule()
                check_step(sched, so2, self.runner)
                self.update(so)
                self.update(so2)
            else:
                if mode == "abort_in_flight" and so.num_scheduled_tokens:
                    ids = list(so.num_scheduled_tokens)
                    sched.finish_requests(ids[victim % len(ids)])
                self.update(so)

    def drain(self):
        self.sched.finish_requests(list(self.sched.requests))
        self.runner(self.sched.schedule())
        assert not self.runner.rows and not self.sched.has_unfinished_requests()
        self.check()
        assert self.sched.kv.num_free_blocks == NUM_BLOCKS - 1 and self.sched.kv.usage == 0.0


event = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)),
    st.tuples(st.just("abort"), st.integers(0, 40)),
    st.tuples(st.just("step"), st.sampled_from(["sync", "sync", "ahead", "abort_in_flight"]), st.integers(0, 3)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(event, min_size=1, max_size=80), st.booleans(), st.sampled_from(["fcfs", "priority"]),
       st.sampled_from([None, NGRAM]))
def test_random_events_keep_the_pool_consistent(evts, caching, policy, spec):
    d = Driver(caching, policy, spec)
    for ev in evts:
        d.apply(ev)
    d.drain()


@pytest.mark.parametrize("caching, policy, spec",
                         [(True, "fcfs", None), (False, "fcfs", None), (True, "priority", None), (True, "fcfs", NGRAM)])
def test_long_random_run(caching, policy, spec):
    """Thousands of events in one run: preemptions, aborts and finishes all happen."""
    import random

    rng = random.Random(1234)
    d = Driver(caching, policy, spec)
    for _ in range(3000):
        x = rng.random()
        if x < 0.3:
            d.apply(("add", rng.randint(1, 30), rng.randint(1, 12), rng.randint(0, 3)))
        elif x < 0.35:
            d.apply(("abort", rng.randint(max(0, d.serial - 10), d.serial)))
        else:
            d.apply(("step", rng.choice(["sync", "sync", "ahead", "abort_in_flight"]), rng.randint(0, 3)))
    assert d.sched.num_preemptions > 20 and d.finished > 100
    if caching:
        assert d.sched.kv.prefix_cache_hits > 0
    if spec:
        assert 0 < d.sched.num_accepted_tokens < d.sched.num_draft_tokens
    d.drain()
