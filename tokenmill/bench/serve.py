"""`tokenmill bench serve` (W3): load any OpenAI-compatible server (tokenmill's, vLLM's) with random prompts.

Each request streams from /v1/completions: exactly --input-len prompt tokens (token-id prompts when the
server takes them, else their text via the server's /detokenize), --output-len new tokens (greedy,
`ignore_eos` and `min_tokens`, which tokenmill and vLLM both accept). Requests start at once, bounded
by --max-concurrency, or as a Poisson process of --request-rate per second.

A tokenmill server compiles its shape buckets in the background while it already serves; the benchmark
waits for its `tokenmill:num_ranks_precompiling` gauge to reach 0 (servers without it are not waited
for), so that no timed step stops to compile.

Per request: TTFT (first content chunk), TPOT ((e2e - TTFT) / (tokens - 1)), ITL (gaps between content
chunks), end-to-end latency. Reported: mean, p50 and p99 of each, output and total tokens/s over the
benchmark's wall time, and failed requests (counted, never dropped silently). Optionally a JSON file and
a PNG of the latency distributions (needs matplotlib: `pip install tokenmill[bench]`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx
from tqdm.auto import tqdm

from tokenmill.bench.workloads import THROUGHPUT_SEED, random_prompts


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    sent: float = 0.0  # perf_counter() when the request was sent
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


class BenchClient:
    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str, output_len: int):
        self.client = client
        self.url = f"{base_url}/v1/completions"
        self.model = model
        self.output_len = output_len

    def body(self, prompt, max_tokens: int) -> dict:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}

    async def request(self, prompt, num_prompt_tokens: int, max_tokens: int | None = None) -> RequestResult:
        result = RequestResult(prompt_tokens=num_prompt_tokens)
        start = last = result.sent = time.perf_counter()
        chunks = 0
        try:
            async with self.client.stream("POST", self.url, json=self.body(prompt, max_tokens or self.output_len)) as r:
                if r.status_code != 200:
                    result.error = f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}"
                    return result
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if event.get("error"):
                        result.error = str(event["error"].get("message", event["error"]))
                        return result
                    if event.get("usage"):
                        result.output_tokens = event["usage"].get("completion_tokens", 0)
                    if event.get("choices") and event["choices"][0].get("text"):
                        now = time.perf_counter()
                        if result.ttft is None:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        chunks += 1
            result.e2e = time.perf_counter() - start
            result.output_tokens = result.output_tokens or chunks
            result.ok = result.ttft is not None
            if not result.ok:
                result.error = "no output"
        except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
            result.error = f"{type(e).__name__}: {e}"
        return result


async def _prompts(client: httpx.AsyncClient, args, bench: BenchClient) -> list:
    """The prompts as the server will take them: token ids if it accepts them, else their text."""
    seed = THROUGHPUT_SEED if args.seed is None else args.seed
    ids = random_prompts(args.num_prompts, args.input_len, seed)
    fmt = args.prompt_format
    if fmt == "auto":
        probe = dict(bench.body(ids[0], 1), stream=False)
        probe.pop("stream_options")
        r = await client.post(bench.url, json=probe)
        fmt = "ids" if r.status_code == 200 else "text"
    if fmt == "ids":
        return ids
    texts = []
    for p in ids:
        r = await client.post(f"{args.base_url.rstrip('/')}/detokenize", json={"model": bench.model, "tokens": p})
        r.raise_for_status()
        texts.append(r.json()["prompt"])
    return texts


def _stats(name: str, values: list[float]) -> dict:
    if not values:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"p99_{name}_ms": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {f"mean_{name}_ms": 1000 * statistics.fmean(values), f"median_{name}_ms": 1000 * statistics.median(values),
            f"p99_{name}_ms": 1000 * p99}


PRECOMPILING_GAUGE = "tokenmill:num_ranks_precompiling"


async def wait_precompiled(client: httpx.AsyncClient, base: str, timeout_s: float = 900.0) -> None:
    """Wait until the server's precompiling gauge reads 0; no wait for a server without the gauge."""
    deadline = time.monotonic() + timeout_s
    told = False
    while True:
        r = await client.get(f"{base}/metrics")
        values = [float(line.rsplit(" ", 1)[1]) for line in r.text.splitlines()
                  if r.status_code == 200 and line.startswith(PRECOMPILING_GAUGE)]
        if not values or sum(values) == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server still compiles its shape buckets after {timeout_s:.0f} s")
        if not told:
            print("bench serve: waiting for the server to finish compiling its shape buckets", file=sys.stderr)
            told = True
        await asyncio.sleep(0.5)


async def benchmark(args) -> tuple[dict, list[RequestResult]]:
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or max(args.num_prompts, 1) + 4,
                          max_keepalive_connections=args.max_concurrency or args.num_prompts + 4)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        model = args.model
        if model is None:
            r = await client.get(f"{base}/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        bench = BenchClient(client, base, model, args.output_len)
        prompts = await _prompts(client, args, bench)
        await wait_precompiled(client, base)
        for _ in range(args.warmup_requests):  # excluded: first-use compiles, connection set-up
            warm = await bench.request(prompts[0], args.input_len, max_tokens=min(4, args.output_len))
            if not warm.ok:
                raise RuntimeError(f"warm-up request failed: {warm.error}")

        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(prompts), desc="bench serve", disable=args.no_progress, file=sys.stderr)
        rng = random.Random(0)

        async def one(prompt) -> RequestResult:
            if semaphore is None:
                result = await bench.request(prompt, args.input_len)
            else:
                async with semaphore:
                    result = await bench.request(prompt, args.input_len)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if math.isfinite(args.request_rate) and args.request_rate > 0:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()

    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "workload": "serve", "base_url": base, "model": model,
        "num_prompts": len(prompts), "input_len": args.input_len, "output_len": args.output_len,
        "max_concurrency": args.max_concurrency,
        "request_rate": None if not math.isfinite(args.request_rate) else args.request_rate,
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tok_s": out_tokens / duration,
        "total_tok_s": (out_tokens + in_tokens) / duration,
        "total_output_tokens": out_tokens,
        **_stats("ttft", [r.ttft for r in ok]),
        **_stats("tpot", [r.tpot for r in ok if r.tpot is not None]),
        **_stats("itl", [x for r in ok for x in r.itl]),
        **_stats("e2el", [r.e2e for r in ok]),
        # each request's send time (s after the run's start), TTFT and end-to-end latency (s), in
        # send order: shows how the server schedules arrivals, which the percentiles hide
        "requests": [{"sent_s": round(r.sent - start, 4), "ttft_s": r.ttft and round(r.ttft, 4),
                      "e2el_s": r.e2e and round(r.e2e, 4)} for r in sorted(results, key=lambda r: r.sent)],
    }
    return summary, results


def plot(results: list[RequestResult], path: str, title: str) -> bool:
    """Histograms of TTFT, TPOT, ITL and end-to-end latency; False if matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in results if r.ok]
    series = {
        "TTFT (ms)": [1000 * r.ttft for r in ok],
        "TPOT (ms)": [1000 * r.tpot for r in ok if r.tpot is not None],
        "ITL (ms)": [1000 * x for r in ok for x in r.itl],
        "end-to-end (s)": [r.e2e for r in ok],
    }
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (name, values) in zip(axes, series.items()):
        if values:
            ax.hist(values, bins=min(40, max(5, len(values) // 2)))
            for q, style in ((0.5, "--"), (0.99, ":")):
                ax.axvline(sorted(values)[min(len(values) - 1, int(q * len(values)))], color="k", linestyle=style)
        ax.set_title(name)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run(args) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    try:
        summary, results = asyncio.run(benchmark(args))
    except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as e:
        print(f"tokenmill: error: bench serve against {args.base_url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)
    png = args.plot or (os.path.splitext(args.output_json)[0] + ".png" if args.output_json else None)
    if png:
        title = (f"{summary['model']}: {args.num_prompts} x {args.input_len}+{args.output_len} tokens, "
                 f"concurrency {args.max_concurrency or 'unbounded'}")
        if plot(results, png, title):
            print(f"latency distributions: {png}", file=sys.stderr)
        else:
            print("matplotlib is not installed: no PNG (pip install 'tokenmill[bench]')", file=sys.stderr)
    return 0 if summary["failed_requests"] == 0 else 1
