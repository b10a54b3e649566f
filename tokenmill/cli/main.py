"""The `tokenmill` command: `tokenmill bench {throughput,latency}`."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenmill import envs


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill")
    commands = parser.add_subparsers(dest="command", required=True)
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
    for p in (thr, lat):
        p.add_argument("--reps", type=int, default=3)
        p.add_argument("--output-json", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        logging.basicConfig(level=envs.TOKENMILL_LOGGING_LEVEL, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if args.command == "bench":
            from tokenmill.bench import offline

            offline.run(args)
    except (ValueError, OSError) as e:  # bad input: one clear line, no traceback
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
