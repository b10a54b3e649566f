"""Data-parallel engine cores (data_parallel_size=2): real processes, real ZMQ, tiny random models.

A dense Llama over two independent ranks: outputs equal one engine's, requests spread, aborts reach
the rank that holds the request, a dying rank fails everything in flight. A Mixtral served expert
parallel steps in waves: the idle rank runs dummy batches while the other works, both stop together
and go idle, a later request starts the next wave. Plus the pieces without processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from serving import drain_until_dead, wait_for
from tests.tiny_models import make_tiny_checkpoint
from tokenmill.engine import messages as m
from tokenmill.sampling_params import SamplingParams

TINY_ARGS = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_blocks=64)
PROMPTS = [[5 + i, 17, 42 + 3 * i, 99, 7, 3 + i] for i in range(8)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


async def _tokens(engine, prompt, params, request_id) -> list[int]:
    tokens = []
    async for out in engine.generate(prompt, params, request_id):
        tokens.extend(out.outputs[0].token_ids)
    return tokens


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("dp") / "llama")
    make_tiny_checkpoint("LlamaForCausalLM", path)
    return path


@pytest.fixture(scope="module")
def dp_engine(llama_dir, loop):
    from tokenmill.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(llama_dir, data_parallel_size=2, **TINY_ARGS)
    yield engine
    engine.shutdown()
    loop.run_until_complete(asyncio.sleep(0))  # let the cancelled watchdog finish


# ---- two independent ranks (a dense model) -------------------------------------------------------


def test_dp2_outputs_equal_one_engine_and_requests_spread_over_the_ranks(dp_engine, loop, llama_dir):
    from tokenmill import LLM

    assert dp_engine.client.num_ranks == 2 and not dp_engine.client.wave_mode
    assert len(set(dp_engine.client.pids)) == 2

    async def scenario():
        before = await dp_engine.call_utility_all("get_stats")
        outs = await asyncio.gather(*(_tokens(dp_engine, p, _greedy(12), f"eq-{i}") for i, p in enumerate(PROMPTS)))
        after = await dp_engine.call_utility_all("get_stats")
        return outs, [a["num_requests_received"] - b["num_requests_received"] for a, b in zip(after, before)]

    outs, per_rank = loop.run_until_complete(scenario())
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    ref = LLM(llama_dir, **TINY_ARGS).generate(PROMPTS, with_logprobs, use_tqdm=False)
    for out, r in zip(outs, ref):
        expected = r.outputs[0].token_ids
        assert len(out) == len(expected) == 12
        agree = next((i for i, (a, b) in enumerate(zip(out, expected)) if a != b), len(expected))
        if agree < len(expected):
            # this random model's logits are nearly flat, and a request batched with 3 others instead of
            # 7 (other padding) may move a logit by an ulp (XLA's row-wise ops): only an exact tie flips
            top2 = sorted((lp.logprob for lp in r.outputs[0].logprobs[agree].values()), reverse=True)[:2]
            assert top2[0] - top2[1] < 1e-5, (agree, top2, out, expected)
    assert per_rank == [4, 4], per_rank  # a burst alternates between equally loaded ranks

    stats = loop.run_until_complete(dp_engine.get_stats())  # merged over the ranks
    assert stats["data_parallel_size"] == 2 and stats["num_blocks"] == 2 * TINY_ARGS["num_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert loop.run_until_complete(dp_engine.reset_prefix_cache()) is True


def test_dp2_abort_reaches_the_rank_that_holds_the_request(dp_engine, loop):
    async def scenario():
        before = await dp_engine.call_utility_all("get_stats")
        # rank 0 is busy with a long request, so the one to cancel goes to rank 1
        busy = asyncio.ensure_future(_tokens(dp_engine, PROMPTS[0], _greedy(60), "busy"))
        await asyncio.sleep(0)
        gen = dp_engine.generate(PROMPTS[1], _greedy(100), "to-cancel")
        await gen.__anext__()
        rank = dp_engine.client.rank_of("to-cancel")
        await gen.aclose()

        async def settled():
            stats = await dp_engine.call_utility_all("get_stats")
            aborted = [s["num_aborted_requests"] - b["num_aborted_requests"] for s, b in zip(stats, before)]
            return aborted if stats[rank]["num_running"] == 0 and sum(aborted) == 1 else None

        for _ in range(50):
            aborted = await settled()
            if aborted:
                break
            await asyncio.sleep(0.1)
        return rank, aborted, await busy

    rank, aborted, busy_tokens = loop.run_until_complete(scenario())
    assert rank == 1 and aborted == [0, 1]
    assert len(busy_tokens) == 60 and dp_engine.num_in_flight == 0


def test_bench_throughput_over_two_ranks(dp_engine, loop, monkeypatch):
    from tokenmill.bench import data_parallel

    # the W1 prompts' ids are SmolLM2's; the tiny model's vocabulary is 256
    monkeypatch.setattr(data_parallel, "random_prompts", lambda n, length, seed: [[4 + i] * length for i in range(n)])
    result = loop.run_until_complete(data_parallel.throughput(dp_engine, num_prompts=6, input_len=8,
                                                              output_len=5, reps=2))
    assert result["data_parallel_size"] == 2 and result["requests_per_rank"] == [3, 3]
    assert result["output_tok_s_median"] > 0 and len(result["wall_s"]) == 2 and result["step_ms"] > 0


def test_dp2_killed_rank_fails_every_inflight_request_within_5_s(dp_engine, loop):
    from tokenmill.engine.async_llm import EngineDeadError

    async def scenario():
        gens = [dp_engine.generate(p, _greedy(120), f"doomed-{i}") for i, p in enumerate(PROMPTS[:4])]
        firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
        await asyncio.sleep(0)  # each generator adds its request, then waits for its first output
        assert sorted(dp_engine.client.rank_of(f"doomed-{i}") for i in range(4)) == [0, 0, 1, 1]
        # rank 0 is paused at once: none of the four can finish before the death is noticed, however
        # fast the ranks are (waiting for first outputs let a fast rank finish all its tokens)
        os.kill(survivor, signal.SIGSTOP)
        os.kill(dp_engine.client.pids[1], signal.SIGKILL)
        start = time.monotonic()

        async def drain(first, gen):
            try:
                await first
            except EngineDeadError as e:
                return e
            return await drain_until_dead(gen)

        errors = await asyncio.wait_for(asyncio.gather(*(drain(f, g) for f, g in zip(firsts, gens))), timeout=10)
        return errors, time.monotonic() - start

    survivor = dp_engine.client.pids[0]
    try:
        errors, elapsed = loop.run_until_complete(scenario())
    finally:
        os.kill(survivor, signal.SIGCONT)
    assert all(isinstance(e, EngineDeadError) for e in errors) and elapsed < 5.0, (errors, elapsed)
    assert dp_engine.errored and "died" in dp_engine.dead_reason and "rank 1" in dp_engine.dead_reason
    with pytest.raises(EngineDeadError):
        loop.run_until_complete(_tokens(dp_engine, PROMPTS[0], _greedy(2), "after"))


# ---- waves (an expert-parallel MoE model) --------------------------------------------------------


@pytest.fixture(scope="module")
def wave_engine(tmp_path_factory, loop):
    from tokenmill.engine.async_llm import AsyncLLM

    path = str(tmp_path_factory.mktemp("dp") / "mixtral")
    make_tiny_checkpoint("MixtralForCausalLM", path)
    engine = AsyncLLM.from_engine_args(path, data_parallel_size=2, enable_expert_parallel=True, **TINY_ARGS)
    yield engine
    engine.shutdown()
    loop.run_until_complete(asyncio.sleep(0))  # let the cancelled watchdog finish


def _wait_idle(engine, loop, wave: int) -> list[dict]:
    """Both ranks' wave state once both have gone idle after `wave` (the front end heard it too)."""
    def idle():
        states = loop.run_until_complete(engine.call_utility_all("get_wave_state"))
        done = all(not s["running"] and s["wave"] == wave + 1 for s in states)
        return states if done and engine.client.wave == wave + 1 and not engine.client.wave_running else None

    states = wait_for(idle, 20, interval=0.1)
    assert states, loop.run_until_complete(engine.call_utility_all("get_wave_state"))
    return states


def _steps(state: dict) -> int:
    return state["num_real_steps"] + state["num_dummy_steps"]


def test_waves_idle_rank_steps_dummy_batches_and_both_stop_together(wave_engine, loop):
    from tokenmill.engine.dp_coordinator import WAVE_SYNC_STEPS

    assert wave_engine.client.wave_mode  # on by itself: MoE + expert parallel + 2 ranks
    states = loop.run_until_complete(wave_engine.call_utility_all("get_wave_state"))
    assert [(s["wave"], s["running"], _steps(s)) for s in states] == [(0, False, 0), (0, False, 0)]

    tokens = loop.run_until_complete(_tokens(wave_engine, PROMPTS[0], _greedy(40), "wave-0"))
    assert len(tokens) == 40
    first = _wait_idle(wave_engine, loop, wave=0)
    busy, idle = first
    assert busy["num_real_steps"] >= 40 and idle["num_real_steps"] == 0 and idle["num_dummy_steps"] > 0
    # lock-step: the same number of steps on both ranks, ended at a sync point
    assert _steps(busy) == _steps(idle) and _steps(busy) % WAVE_SYNC_STEPS == 0
    assert wave_engine.client.coordinator.num_reductions == _steps(busy) // WAVE_SYNC_STEPS
    time.sleep(0.5)  # idle means idle: no step while there is no work
    assert loop.run_until_complete(wave_engine.call_utility_all("get_wave_state")) == first

    # a request after the wave ended starts the next one, on every rank
    tokens = loop.run_until_complete(_tokens(wave_engine, PROMPTS[1], _greedy(10), "wave-1"))
    assert len(tokens) == 10
    second = _wait_idle(wave_engine, loop, wave=1)
    assert all(_steps(b) > _steps(a) for a, b in zip(first, second))
    assert _steps(second[0]) == _steps(second[1]) and _steps(second[0]) % WAVE_SYNC_STEPS == 0
    assert second[1]["num_real_steps"] == 0 and second[1]["num_dummy_steps"] > first[1]["num_dummy_steps"]


def test_a_request_that_reaches_an_idle_rank_starts_the_wave_everywhere(wave_engine, loop):
    """The front end believes a wave is still running (it has not heard that it ended): the rank that
    gets the request starts the next wave itself and asks for it on every rank."""
    client = wave_engine.client
    wave = client.wave
    client.wave, client.wave_running = wave - 1, True  # as if the last wave_complete were still on its way
    tokens = loop.run_until_complete(_tokens(wave_engine, PROMPTS[2], _greedy(8), "late"))
    assert len(tokens) == 8
    states = _wait_idle(wave_engine, loop, wave=wave)
    assert [s["wave"] for s in states] == [wave + 1, wave + 1]


# ---- the pieces, without processes ---------------------------------------------------------------


def test_invalid_data_parallel_sizes_are_refused_with_a_clear_error(llama_dir):
    from tokenmill import LLM
    from tokenmill.cli.main import main
    from tokenmill.config import engine_config_from_kwargs
    from tokenmill.engine.async_llm import AsyncLLM

    for size in (0, -1):
        with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1"):
            engine_config_from_kwargs(None, data_parallel_size=size)
        with pytest.raises(ValueError, match="data_parallel_size"):
            AsyncLLM.from_engine_args(llama_dir, data_parallel_size=size)
    with pytest.raises(ValueError, match="LLM runs one engine core"):
        LLM(llama_dir, data_parallel_size=2)
    assert main(["bench", "throughput", "--model", llama_dir, "--data-parallel-size", "0"]) == 2


def test_each_rank_sees_its_own_slice_of_the_devices():
    from tokenmill.config import ParallelConfig
    from tokenmill.engine.dp_devices import rank_visible_devices

    dp2, dp2_tp2 = ParallelConfig(data_parallel_size=2), ParallelConfig(data_parallel_size=2, tensor_parallel_size=2)
    assert rank_visible_devices(0, ParallelConfig(), {}) is None  # one rank: the environment as it is
    assert [rank_visible_devices(r, dp2, {}) for r in (0, 1)] == ["0", "1"]
    assert [rank_visible_devices(r, dp2_tp2, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) for r in (0, 1)] == ["4,5", "6,7"]
    assert rank_visible_devices(1, dp2, {"CUDA_VISIBLE_DEVICES": ""}) == ""  # GPUs hidden stay hidden
    with pytest.raises(ValueError, match="needs 4 devices"):
        rank_visible_devices(0, dp2_tp2, {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_the_least_loaded_rank_takes_the_next_request():
    from tokenmill.engine.dp_load_balancer import RankLoads

    loads = RankLoads(3)
    picks = []
    for _ in range(6):  # a burst before any rank answers: round robin
        picks.append(loads.pick())
        loads.on_sent(picks[-1])
    assert picks == [0, 1, 2, 0, 1, 2]
    loads.on_counts(0, m.RankCounts(num_waiting=0, num_running=0, num_received=2))  # rank 0 finished both
    loads.on_counts(1, m.RankCounts(num_waiting=1, num_running=1, num_received=1))  # one still in transit
    assert [loads.load(r) for r in range(3)] == [0, 3, 2] and loads.pick() == 0
