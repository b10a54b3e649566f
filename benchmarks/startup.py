"""Start-up to the first token for the default model (the performance issue's start-up target).

Each measurement is a fresh process, one after the other:
- offline: `LLM()` then one greedy token (import time included), and when every shape bucket has compiled;
- server: `tokenmill serve` until /v1/models answers, then one completion token.
"cold" runs use an empty compilation cache and tokenizer cache (TOKENMILL_COMPILATION_CACHE_DIR and
TOKENMILL_TOKENIZER_CACHE_DIR in a new temp dir);
the C++ kernels are built beforehand (`python -m tokenmill.ops.cpu`, as `make run` does).
Usage: .venv/bin/python benchmarks/startup.py [--warm N] [--cold N] [--serve N]
Prints one RESULT line of JSON (seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

OFFLINE = """
import time
t0, started = time.perf_counter(), time.time()
from tokenmill.engine.llm import LLM
from tokenmill.sampling_params import SamplingParams
llm = LLM(None)
ready = time.perf_counter() - t0
llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
first = time.perf_counter() - t0
llm.engine.wait_precompiled()
print(started, ready, first, time.perf_counter() - t0)
"""


def offline(cache_dir: str | None) -> dict:
    env = dict(os.environ)
    if cache_dir is not None:
        env["TOKENMILL_COMPILATION_CACHE_DIR"] = cache_dir
        env["TOKENMILL_TOKENIZER_CACHE_DIR"] = os.path.join(cache_dir, "tokenizers")
    start = time.time()
    out = subprocess.run([sys.executable, "-c", OFFLINE], env=env, capture_output=True, text=True, check=True)
    started, ready, first, compiled = (float(x) for x in out.stdout.split()[-4:])
    # the interpreter's start before t0, by the wall clock both processes read (not the whole run less
    # `compiled`: that counted the process's exit too)
    spawn = started - start
    return {"ready_s": ready + spawn, "first_token_s": first + spawn, "all_compiled_s": compiled + spawn}


def serve(port: int = 8011) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "tokenmill"), "serve", "--host",
                             "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError("tokenmill serve exited during start-up")
                time.sleep(0.05)
        ready = time.perf_counter() - start
        body = json.dumps({"prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=120).read()
        return {"ready_s": ready, "first_token_s": time.perf_counter() - start}
    finally:
        proc.terminate()
        proc.wait(60)


def summary(runs: list[dict]) -> dict:
    return {key: {"median": statistics.median(r[key] for r in runs), "min": min(r[key] for r in runs),
                  "max": max(r[key] for r in runs), "runs": [round(r[key], 2) for r in runs]} for key in runs[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warm", type=int, default=5)
    p.add_argument("--cold", type=int, default=2)
    p.add_argument("--serve", type=int, default=3)
    args = p.parse_args()
    result = {}
    offline(None)  # fills the compilation cache, so the warm runs are warm
    if args.warm:
        result["offline_warm"] = summary([offline(None) for _ in range(args.warm)])
    if args.cold:
        cold = []
        for _ in range(args.cold):
            with tempfile.TemporaryDirectory() as empty:
                cold.append(offline(empty))
        result["offline_cold"] = summary(cold)
    if args.serve:
        result["serve_warm"] = summary([serve() for _ in range(args.serve)])
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
