"""The `tokenmill` command: `tokenmill serve [MODEL]` and `tokenmill bench {throughput,latency,serve,moe}`."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from tokenmill import envs
from tokenmill.config import KV_CACHE_DTYPES


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV cache's element type (auto: the model's compute dtype); bfloat16 halves a float32 "
                        "model's cache, and the bytes decode attention reads each step")
    p.add_argument("--quantization", "-q", default=None, choices=["int8", "fp8_e4m3", "fp8_e5m2", "w8a16", "w8a16_int", "gguf",
                                                                  "gguf_int"],
                   help="store the projections and the LM head in 8 bits (quantized at load time, one scale "
                        "per 64 rows of each reduction axis); w8a16: int8 weights, inputs rounded to bfloat16 "
                        "(multiplied with AMX or AVX512-BF16 where the CPU has them); w8a16_int: int8 weights, "
                        "inputs quantized to 16-bit integers per window (integer dot products, AVX512-VNNI where "
                        "the CPU has it); gguf: keep a GGUF file's Q8_0 / Q4_0 / "
                        "Q4_1 blocks as they are (4-bit weights stay 4-bit); gguf_int: the same blocks, inputs quantized "
                        "to 16-bit integers as w8a16_int's")
    p.add_argument("--expert-quantization", default=None, choices=["int8", "fp8_e4m3", "fp8_e5m2"],
                   help="store an MoE model's experts in 8 bits (quantized at load time)")
    p.add_argument("--expert-quantization-window", type=int, default=256,
                   help="rows of the reduction axis per quantization scale")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="devices to split the model over (attention heads, MLP columns)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="split MoE experts whole over the tensor-parallel devices")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine-core processes, each with its own model replica and share of the requests")
    p.add_argument("--data-parallel-backend", "-dpb", default="mp", choices=["mp", "ray"],
                   help="where the data-parallel engine cores run: local processes (mp) or Ray actors "
                        "anywhere in the cluster (ray)")
    p.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s form: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (each decode step also computes up to '
                        "num_speculative_tokens tokens proposed by prompt lookup and keeps those the model's own "
                        "picks agree with: the output is plain decoding's)")
    p.add_argument("--distributed-executor-backend", default=None, choices=["ray"],
                   help="run the model across hosts: one Ray worker per host (default: in this process; "
                        "also TOKENMILL_MULTIHOST_BACKEND=ray)")


def _speculative_config(raw: str):
    from tokenmill.config import SpeculativeConfig

    try:
        return SpeculativeConfig.from_value(raw)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _str_list(raw: str) -> list[str]:
    """A JSON list (vLLM's form: '["http://a", "http://b"]') or comma-separated values."""
    raw = raw.strip()
    if raw.startswith("["):
        value = json.loads(raw)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return value
    return [v.strip() for v in raw.split(",") if v.strip()]


def _add_serve_parser(commands) -> None:
    p = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    _add_engine_args(p)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="launch step N+1 before collecting step N")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed when ready)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model name(s) the API accepts (default: MODEL as given)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on the API")
    p.add_argument("--allowed-origins", type=_str_list, default=["*"], help="CORS origins (JSON list or a,b)")
    p.add_argument("--allowed-methods", type=_str_list, default=["*"])
    p.add_argument("--allowed-headers", type=_str_list, default=["*"])
    p.add_argument("--allow-credentials", action="store_true")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--disable-access-log", "--disable-uvicorn-access-log", action="store_true")


def _run_serve(args) -> int:
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    from tokenmill.api.server import run_server
    from tokenmill.engine.client import EngineStartupError

    try:
        return run_server(args)
    except EngineStartupError as e:
        print(f"tokenmill: error: the engine failed to start: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(commands)
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    thr = bench.add_parser("throughput", help="W1: offline batch throughput")
    _add_engine_args(thr)
    thr.add_argument("--num-prompts", type=int, default=64)
    thr.add_argument("--input-len", type=int, default=128)
    thr.add_argument("--output-len", type=int, default=128)
    lat = bench.add_parser("latency", help="W2: one stream, TTFT and decode speed")
    _add_engine_args(lat)
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=256)
    lat.add_argument("--prompt", default=None,
                     help="a text prompt (the model's tokenizer, chat template applied) instead of W2's random "
                          "token ids; --input-len is then ignored")
    for p in (thr, lat):
        p.add_argument("--reps", type=int, default=3)
        p.add_argument("--output-json", default=None)
    moe = bench.add_parser("moe", help="one MoE layer (Qwen3-30B-A3B's shapes): fused_moe, ref_moe, dense matmuls")
    moe.add_argument("--num-tokens", type=int, default=512)
    moe.add_argument("--hidden", type=int, default=2048)
    moe.add_argument("--intermediate", type=int, default=768, help="each expert's intermediate size")
    moe.add_argument("--experts", type=int, default=128)
    moe.add_argument("--top-k", type=int, default=8)
    moe.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    moe.add_argument("--quant", default="none", choices=["none", "int8", "fp8_e4m3", "fp8_e5m2"])
    moe.add_argument("--wsz", type=int, default=256, help="quantization window: reduction-axis rows per scale")
    moe.add_argument("--reps", type=int, default=3)
    moe.add_argument("--output-json", default=None)
    srv = bench.add_parser("serve", help="W3: an OpenAI-compatible server under load (tokenmill's or any other)")
    srv.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    srv.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    srv.add_argument("--api-key", default=None)
    srv.add_argument("--num-prompts", type=int, default=64)
    srv.add_argument("--input-len", type=int, default=128)
    srv.add_argument("--output-len", type=int, default=128)
    srv.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    srv.add_argument("--request-rate", type=float, default=float("inf"),
                     help="Poisson arrivals per second (inf: all at once, bounded by --max-concurrency)")
    srv.add_argument("--prompt-format", choices=["auto", "ids", "text"], default="auto",
                     help="send token-id prompts (auto: if the server accepts them) or decoded text")
    srv.add_argument("--seed", type=int, default=None, help="prompt seed (default: the W1 seed)")
    srv.add_argument("--warmup-requests", type=int, default=1)
    srv.add_argument("--request-timeout", type=float, default=600.0)
    srv.add_argument("--output-json", default=None)
    srv.add_argument("--plot", default=None, help="PNG of the latency distributions (default: beside --output-json)")
    srv.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        logging.basicConfig(level=envs.TOKENMILL_LOGGING_LEVEL, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if args.command == "serve":
            return _run_serve(args)
        if args.command == "bench" and args.bench == "serve":
            from tokenmill.bench import serve

            return serve.run(args)
        if args.command == "bench" and args.bench == "moe":
            from tokenmill.bench import moe

            moe.run(args)
            return 0
        if args.command == "bench":
            from tokenmill.bench import offline

            offline.run(args)
    except (ValueError, OSError) as e:  # bad input: one clear line, no traceback
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
