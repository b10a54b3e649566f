"""`tokenmill bench throughput` (W1) and `tokenmill bench latency` (W2), through the offline engine
(with --data-parallel-size > 1, W1 runs behind AsyncLLM instead: data_parallel.py)."""

from __future__ import annotations

import dataclasses
import json
import resource
import statistics
import time

from tokenmill.bench.workloads import LATENCY_SEED, THROUGHPUT_SEED, random_prompts
from tokenmill.engine.llm import LLM
from tokenmill.sampling_params import SamplingParams


def _rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)


def _summary(name: str, values: list[float]) -> dict:
    return {f"{name}_median": statistics.median(values), f"{name}_min": min(values), f"{name}_max": max(values)}


def throughput(llm: LLM, num_prompts: int, input_len: int, output_len: int, reps: int) -> dict:
    prompts = random_prompts(num_prompts, input_len, THROUGHPUT_SEED)
    llm.generate(prompts, _greedy(4), use_tqdm=False)  # warm-up (excluded)
    walls, rss, host_ms_per_step, step_ms = [], [], [], []
    engine = llm.engine
    for _ in range(reps):
        engine.reset_prefix_cache()  # every rep computes its prompts, as the peers do
        host0, steps0 = engine.scheduler_host_time, engine.num_steps
        start = time.perf_counter()
        outputs = llm.generate(prompts, _greedy(output_len), use_tqdm=False)
        walls.append(time.perf_counter() - start)
        assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
        steps = engine.num_steps - steps0
        host_ms_per_step.append(1e3 * (engine.scheduler_host_time - host0) / steps)
        step_ms.append(1e3 * walls[-1] / steps)
        rss.append(_rss_mib())
    out_tokens = num_prompts * output_len
    total_tokens = num_prompts * (input_len + output_len)
    return {
        "workload": "throughput",
        "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
        "wall_s": walls,
        "rss_mib_after_each_rep": rss,
        "scheduler_host_ms_per_step": statistics.median(host_ms_per_step),
        "step_ms": statistics.median(step_ms),
        **_summary("output_tok_s", [out_tokens / w for w in walls]),
        **_summary("total_tok_s", [total_tokens / w for w in walls]),
        "sample_req0_first16": outputs[0].outputs[0].token_ids[:16],
    }


def latency(llm: LLM, input_len: int, output_len: int, reps: int, text: str | None = None) -> dict:
    """W2: one request at a time, TTFT and decode tok/s. `text`: a chat message as the prompt instead
    of W2's random ids (what speculative decoding meets on real text)."""
    if text is None:
        prompt = random_prompts(1, input_len, LATENCY_SEED)[0]
    else:
        prompt = llm.processor.tokenize_chat(llm.processor.render_chat([{"role": "user", "content": text}]))
    engine = llm.engine
    llm.generate([prompt], _greedy(4), use_tqdm=False)  # warm-up (excluded)
    ttfts, decode_rates = [], []
    for rep in range(reps):
        before = engine.get_stats()
        engine.reset_prefix_cache()
        engine.add_request(f"latency-{rep}", prompt, _greedy(output_len))
        start = time.perf_counter()
        token_times, tokens = [], []
        while engine.has_unfinished_requests():
            updates = engine.step_with_batch_queue()
            now = time.perf_counter()
            for u in updates:
                tokens.extend(u.new_token_ids)
                token_times.extend([now] * len(u.new_token_ids))
        assert len(tokens) == output_len, len(tokens)
        ttfts.append(token_times[0] - start)
        decode_rates.append((output_len - 1) / (token_times[-1] - token_times[0]))
        after = engine.get_stats()
    result = {
        "workload": "latency",
        "input_len": len(prompt), "output_len": output_len, "prompt": text,
        **_summary("ttft_s", ttfts),
        **_summary("decode_tok_s", decode_rates),
        "sample_first16": tokens[:16],
    }
    if engine.config.speculative_config is not None:  # of the last repetition
        result.update(speculative_config=dataclasses.asdict(engine.config.speculative_config),
                      spec_num_draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
                      spec_num_accepted_tokens=after.num_accepted_tokens - before.num_accepted_tokens)
    return result


def run(args) -> dict:
    engine_args = dict(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_dtype=args.kv_cache_dtype)
    if args.kv_cache_memory is not None:
        engine_args["kv_cache_memory"] = args.kv_cache_memory
    engine_args.update(tensor_parallel_size=args.tensor_parallel_size,
                       enable_expert_parallel=args.enable_expert_parallel,
                       distributed_executor_backend=args.distributed_executor_backend)
    if args.quantization is not None:
        engine_args["quantization"] = args.quantization
    if args.speculative_config is not None:
        engine_args["speculative_config"] = args.speculative_config
    if args.expert_quantization is not None:
        engine_args.update(expert_quantization=args.expert_quantization,
                           expert_quantization_window=args.expert_quantization_window)
    if args.data_parallel_size > 1:
        if args.bench != "throughput":
            raise ValueError(f"bench {args.bench} runs one stream: --data-parallel-size must be 1")
        from tokenmill.bench.data_parallel import run_throughput

        engine_args.update(data_parallel_size=args.data_parallel_size, data_parallel_backend=args.data_parallel_backend)
        result = run_throughput(args, engine_args)
        result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return _report(result, args.output_json)
    start = time.perf_counter()
    llm = LLM(args.model, **engine_args)
    startup = time.perf_counter() - start
    llm.generate([[1]], _greedy(1), use_tqdm=False)  # the first token: the buckets may still be compiling
    first_token = time.perf_counter() - start
    llm.engine.wait_precompiled()  # nothing compiles while the workload is timed
    precompiled = time.perf_counter() - start
    if args.bench == "throughput":
        result = throughput(llm, args.num_prompts, args.input_len, args.output_len, args.reps)
    else:
        result = latency(llm, args.input_len, args.output_len, args.reps, args.prompt)
    result.update(
        engine="tokenmill", model=llm.engine.model.source, startup_s=startup, first_token_s=first_token,
        precompiled_s=precompiled,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )
    return _report(result, args.output_json)


def _report(result: dict, output_json: str | None) -> dict:
    print(json.dumps(result, indent=2))
    if output_json:
        with open(output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
