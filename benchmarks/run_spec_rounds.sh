#!/usr/bin/env bash
# W2 in float32, tokenmill against llama.cpp F32, plain and with n-gram speculative decoding (the same
# proposals on both sides: benchmarks/llama_lookup_peer.py), interleaved run by run for ROUNDS rounds:
# on a shared machine the memory bandwidth a single stream gets moves by tens of percent from one
# minute to the next, so each round compares runs made within a few minutes of each other.
# Usage: benchmarks/run_spec_rounds.sh [OUT_DIR] [ROUNDS] [REPS]   (SPEC_TOKENS, default "4 7")
# Results: one JSON file per run, <engine>-<plain|specK>-r<round>.json; summary: benchmarks/spec_report.py OUT_DIR
set -u
cd "$(dirname "$0")/.."
OUT=${1:-bench_results/spec-$(date +%Y%m%d-%H%M)}
ROUNDS=${2:-3}
REPS=${3:-3}
PEERS=${PEERS_SRC:-../shared/peers}
export PEERS_DIR=${PEERS_DIR:-$HOME/.cache/tokenmill-peers}
[ -f "$PEERS/workload.py" ] || { echo "no peers scripts in $PEERS: set PEERS_SRC" >&2; exit 1; }
PEERS=$(cd "$PEERS" && pwd)
F32=$(ls "$PEERS_DIR"/*F32*.gguf 2>/dev/null | head -1)
[ -n "$F32" ] || { echo "no F32 GGUF in $PEERS_DIR (../shared/peers/make_ggufs.py makes it)" >&2; exit 1; }
mkdir -p "$OUT"
lock() { flock /tmp/bench.lock "$@"; }
result() { grep '^RESULT ' | sed 's/^RESULT //' > "$OUT/$1.json"; }
llama_python="$PEERS_DIR/llama/bin/python"

for r in $(seq 1 "$ROUNDS"); do
  lock .venv/bin/tokenmill bench latency --reps "$REPS" --output-json "$OUT/tokenmill-plain-r$r.json" \
    > "$OUT/tokenmill-plain-r$r.log" 2>&1
  PEERS_SRC="$PEERS" lock "$llama_python" benchmarks/llama_peer.py --workload w2 --gguf "$F32" --reps "$REPS" \
    | result "llama-plain-r$r"
  for k in ${SPEC_TOKENS:-4 7}; do
    lock .venv/bin/tokenmill bench latency --speculative-config "{\"num_speculative_tokens\": $k}" --reps "$REPS" \
      --output-json "$OUT/tokenmill-spec$k-r$r.json" > "$OUT/tokenmill-spec$k-r$r.log" 2>&1
    PEERS_SRC="$PEERS" lock "$llama_python" benchmarks/llama_lookup_peer.py --gguf "$F32" \
      --num-speculative-tokens "$k" --reps "$REPS" | result "llama-spec$k-r$r"
  done
done
echo "results in $OUT"
