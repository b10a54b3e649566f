#!/usr/bin/env bash
# W2 (single-stream decoding), tokenmill against llama.cpp at each of target 3's precisions, interleaved
# run by run: float32 against llama.cpp F32, w8a16_int against Q8_0, the shipped Q4_1 kept (gguf_int)
# against Q4_1. On a shared machine a single stream's memory bandwidth moves by tens of percent from one
# minute to the next, so each ratio compares two runs made back to back, and which engine goes first
# alternates from round to round. Peers are set up as ../shared/peers/README.md says. llama.cpp keeps its
# KV cache in F16 (its default); PRECISIONS=fp32kv16 runs tokenmill's float32 with a bfloat16 cache
# (--kv-cache-dtype bfloat16) against the same F32 file.
# Usage: benchmarks/run_w2_rounds.sh [OUT_DIR] [ROUNDS] [REPS]   (PRECISIONS, default "fp32 int8 q4")
# Results: one JSON file per run, <engine>-<precision>-r<round>.json; summary: benchmarks/w2_report.py OUT_DIR
set -u
cd "$(dirname "$0")/.."
OUT=${1:-bench_results/w2-$(date +%Y%m%d-%H%M)}
ROUNDS=${2:-6}
REPS=${3:-3}
PEERS=${PEERS_SRC:-../shared/peers}
export PEERS_DIR=${PEERS_DIR:-$HOME/.cache/tokenmill-peers}
[ -f "$PEERS/workload.py" ] || { echo "no peers scripts in $PEERS: set PEERS_SRC" >&2; exit 1; }
PEERS=$(cd "$PEERS" && pwd)
mkdir -p "$OUT"
lock() { flock /tmp/bench.lock "$@"; }
gguf() { ls "$PEERS_DIR"/*"$1"*.gguf 2>/dev/null | head -1; }

ours() {  # precision round
  case $1 in
    fp32) args=() ;;
    fp32kv16) args=(--kv-cache-dtype bfloat16) ;;
    int8) args=(--quantization w8a16_int) ;;
    q4) args=(--quantization gguf_int) ;;
  esac
  lock .venv/bin/tokenmill bench latency "${args[@]}" --reps "$REPS" --output-json "$OUT/tokenmill-$1-r$2.json" \
    > "$OUT/tokenmill-$1-r$2.log" 2>&1
}

theirs() {  # precision round (Q4_1: llama_peer.py's default, the shipped file)
  case $1 in
    fp32 | fp32kv16) args=(--gguf "$(gguf F32)") ;;
    int8) args=(--gguf "$(gguf Q8_0)") ;;
    q4) args=() ;;
  esac
  PEERS_SRC="$PEERS" lock "$PEERS_DIR/llama/bin/python" benchmarks/llama_peer.py --workload w2 "${args[@]}" \
    --reps "$REPS" 2> "$OUT/llama-$1-r$2.log" | grep '^RESULT ' | sed 's/^RESULT //' > "$OUT/llama-$1-r$2.json"
}

for p in ${PRECISIONS:-fp32 int8 q4}; do
  case $p in fp32*) need=F32 ;; int8) need=Q8_0 ;; *) need= ;; esac
  [ -z "$need" ] || [ -n "$(gguf $need)" ] || { echo "no $need GGUF in $PEERS_DIR (../shared/peers/make_ggufs.py)" >&2; exit 1; }
done
for r in $(seq 1 "$ROUNDS"); do
  for p in ${PRECISIONS:-fp32 int8 q4}; do
    if [ $((r % 2)) -eq 1 ]; then ours "$p" "$r"; theirs "$p" "$r"; else theirs "$p" "$r"; ours "$p" "$r"; fi
  done
done
echo "results in $OUT"
