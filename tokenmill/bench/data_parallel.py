"""`tokenmill bench throughput --data-parallel-size N` (W1) over N engine-core processes.

The offline engine (LLM) is one engine core in the caller's process, so data parallelism runs
behind the serving front end, AsyncLLM: each rep sends every prompt at once and collects the
streams. Same workload and figures as offline.throughput; steps and scheduler time come from each
rank's stats (a step is every rank's step: step_ms divides by the busiest rank's steps).
"""

from __future__ import annotations

import asyncio
import statistics
import time

from tokenmill.bench.offline import _greedy, _rss_mib, _summary
from tokenmill.bench.workloads import THROUGHPUT_SEED, random_prompts
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.sampling_params import SamplingParams


async def _generate_all(engine: AsyncLLM, prompts: list[list[int]], params: SamplingParams,
                        tag: str) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(prompt, params, f"{tag}-{i}"):
            tokens.extend(out.outputs[0].token_ids)
        return tokens

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


async def throughput(engine: AsyncLLM, num_prompts: int, input_len: int, output_len: int, reps: int) -> dict:
    prompts = random_prompts(num_prompts, input_len, THROUGHPUT_SEED)
    while any(await engine.call_utility_all("precompiling")):  # nothing compiles while the workload is timed
        await asyncio.sleep(0.2)
    await _generate_all(engine, prompts, _greedy(4), "warmup")  # excluded
    client = engine.client
    walls, rss, host_ms_per_step, step_ms, per_rank = [], [], [], [], []
    for rep in range(reps):
        await engine.reset_prefix_cache()  # every rep computes its prompts, as the peers do
        before = await engine.call_utility_all("get_stats")
        start = time.perf_counter()
        outputs = await _generate_all(engine, prompts, _greedy(output_len), f"rep{rep}")
        walls.append(time.perf_counter() - start)
        after = await engine.call_utility_all("get_stats")
        assert all(len(tokens) == output_len for tokens in outputs)
        steps = [a["num_steps"] - b["num_steps"] for a, b in zip(after, before)]
        host = sum(a["scheduler_host_time_s"] - b["scheduler_host_time_s"] for a, b in zip(after, before))
        host_ms_per_step.append(1e3 * host / sum(steps))
        step_ms.append(1e3 * walls[-1] / max(steps))
        per_rank = [a["num_requests_received"] - b["num_requests_received"] for a, b in zip(after, before)]
        rss.append(_rss_mib() + sum(_rss_mib(pid) for pid in (p.pid for p in client.procs)))
    out_tokens = num_prompts * output_len
    total_tokens = num_prompts * (input_len + output_len)
    return {
        "workload": "throughput",
        "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
        "data_parallel_size": client.num_ranks,
        "requests_per_rank": per_rank,
        "wall_s": walls,
        "rss_mib_after_each_rep": rss,  # the front end and every engine core
        "scheduler_host_ms_per_step": statistics.median(host_ms_per_step),
        "step_ms": statistics.median(step_ms),
        **_summary("output_tok_s", [out_tokens / w for w in walls]),
        **_summary("total_tok_s", [total_tokens / w for w in walls]),
        "sample_req0_first16": outputs[0][:16],
    }


def run_throughput(args, engine_args: dict) -> dict:
    start = time.perf_counter()
    engine = AsyncLLM.from_engine_args(args.model, **engine_args)
    startup = time.perf_counter() - start
    try:
        result = asyncio.run(throughput(engine, args.num_prompts, args.input_len, args.output_len, args.reps))
    finally:
        engine.shutdown()
    result.update(engine="tokenmill", model=engine.model.source, startup_s=startup)
    return result
