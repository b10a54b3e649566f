#!/usr/bin/env bash
# One benchmark sitting: tokenmill and its peers on W1/W2 (DESIGN.md), one after the other, under
# one lock so no two timed runs overlap. Peers are set up as ../shared/peers/README.md says.
# Usage: benchmarks/run_sitting.sh [OUT_DIR] [REPS]    (results: one JSON file per run)
# WORKLOADS (default "w1 w2 spec startup"): the parts to run, e.g. WORKLOADS=w2 for single-stream decoding only;
# "spec": W2 in float32 with n-gram speculative decoding (SPEC_TOKENS, default "4 7", tokens proposed a step)
# against llama.cpp F32 verifying the same proposals, and on a text prompt (code) with and without it.
# tokenmill W1 runs W1_REPS (default 10) back-to-back reps, to show memory does not grow.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-bench_results/$(date +%Y%m%d-%H%M)}
REPS=${2:-3}
PEERS=${PEERS_SRC:-../shared/peers}
export PEERS_DIR=${PEERS_DIR:-$HOME/.cache/tokenmill-peers}
# a relative PEERS is taken from the repository root: a clone elsewhere must set PEERS_SRC
[ -f "$PEERS/bench_hf.py" ] || { echo "no peers scripts in $PEERS: set PEERS_SRC" >&2; exit 1; }
PEERS=$(cd "$PEERS" && pwd)
mkdir -p "$OUT"
lock() { flock /tmp/bench.lock "$@"; }
result() { grep '^RESULT ' | sed 's/^RESULT //' > "$OUT/$1.json"; }
want() { [[ " ${WORKLOADS:-w1 w2 spec startup} " == *" $1 "* ]]; }
CODE_PROMPT="Write a Python function that parses a CSV file of orders (id, customer, amount, date) and returns the \
total amount per customer, with docstrings and type hints. Then write unit tests for it."

want w1 && lock .venv/bin/tokenmill bench throughput --reps "${W1_REPS:-10}" --output-json "$OUT/tokenmill-w1.json" > "$OUT/tokenmill-w1.log" 2>&1
want w2 && lock .venv/bin/tokenmill bench latency --reps "$REPS" --output-json "$OUT/tokenmill-w2.json" > "$OUT/tokenmill-w2.log" 2>&1
# W1 with 1024-token prompts (the long-context target compares its total tok/s with W1's)
want w1 && lock .venv/bin/tokenmill bench throughput --input-len 1024 --reps "${LONG_REPS:-2}" --output-json "$OUT/tokenmill-w1-1024.json" > "$OUT/tokenmill-w1-1024.log" 2>&1
want startup && lock .venv/bin/python benchmarks/startup.py | result tokenmill-startup
# --quantization: projections and LM head in 8 bits; gguf: the shipped file's Q4_1 / Q8_0 blocks kept
for q in int8 w8a16 w8a16_int gguf gguf_int; do
  want w1 && lock .venv/bin/tokenmill bench throughput --quantization $q --reps "$REPS" --output-json "$OUT/tokenmill-$q-w1.json" > "$OUT/tokenmill-$q-w1.log" 2>&1
  want w2 && lock .venv/bin/tokenmill bench latency --quantization $q --reps "$REPS" --output-json "$OUT/tokenmill-$q-w2.json" > "$OUT/tokenmill-$q-w2.log" 2>&1
done
# the peers' Q8_0 GGUF with its blocks kept: 8 bits against llama.cpp's Q8_0 on the same file
q8=$(ls "$PEERS_DIR"/*Q8_0*.gguf 2>/dev/null | head -1)
for q in gguf gguf_int; do
  want w2 && [ -n "$q8" ] && lock .venv/bin/tokenmill bench latency --model "$q8" --quantization $q --reps "$REPS" \
    --output-json "$OUT/tokenmill-$q-q8_0-w2.json" > "$OUT/tokenmill-$q-q8_0-w2.log" 2>&1
done
for k in ${SPEC_TOKENS:-4 7}; do
  want spec && lock .venv/bin/tokenmill bench latency --speculative-config "{\"num_speculative_tokens\": $k}" \
    --reps "$REPS" --output-json "$OUT/tokenmill-spec$k-w2.json" > "$OUT/tokenmill-spec$k-w2.log" 2>&1
done
want spec && lock .venv/bin/tokenmill bench latency --prompt "$CODE_PROMPT" --reps "$REPS" \
  --output-json "$OUT/tokenmill-code-w2.json" > "$OUT/tokenmill-code-w2.log" 2>&1
want spec && lock .venv/bin/tokenmill bench latency --prompt "$CODE_PROMPT" --speculative-config '{"num_speculative_tokens": 4}' \
  --reps "$REPS" --output-json "$OUT/tokenmill-code-spec4-w2.json" > "$OUT/tokenmill-code-spec4-w2.log" 2>&1
want w1 && (cd "$PEERS" && lock "$PEERS_DIR/hf/bin/python" bench_hf.py --workload w1 --reps "$REPS") | result hf-w1
want w2 && (cd "$PEERS" && lock "$PEERS_DIR/hf/bin/python" bench_hf.py --workload w2 --reps "$REPS") | result hf-w2
# llama.cpp through benchmarks/llama_peer.py: its AMX / repacked buffers off (they crash on Q8_0 / Q4_1)
llama() { PEERS_SRC="$PEERS" lock "$PEERS_DIR/llama/bin/python" benchmarks/llama_peer.py "$@"; }
want w2 && llama --workload w2 --reps "$REPS" | result llama-q4_1-w2
want w1 && llama --workload w1 --reps "$REPS" | result llama-q4_1-w1
for q in Q8_0 F32; do
  g=$(ls "$PEERS_DIR"/*"$q"*.gguf 2>/dev/null | head -1)
  want w2 && [ -n "$g" ] && llama --workload w2 --gguf "$g" --reps "$REPS" | result "llama-$q-w2"
done
f32=$(ls "$PEERS_DIR"/*F32*.gguf 2>/dev/null | head -1)
for k in ${SPEC_TOKENS:-4 7}; do  # the same n-gram proposals, verified by llama.cpp
  want spec && [ -n "$f32" ] && PEERS_SRC="$PEERS" lock "$PEERS_DIR/llama/bin/python" benchmarks/llama_lookup_peer.py \
    --gguf "$f32" --num-speculative-tokens "$k" --reps "$REPS" | result "llama-F32-lookup$k-w2"
done
export VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0
want w1 && (cd "$PEERS" && lock "$PEERS_DIR/vllm/bin/python" bench_vllm.py --workload w1 --reps "$REPS") | result vllm-w1
want w2 && (cd "$PEERS" && lock "$PEERS_DIR/vllm/bin/python" bench_vllm.py --workload w2 --reps "$REPS") | result vllm-w2
(cd "$PEERS" && lock "$PEERS_DIR/hf/bin/python" limits.py) > "$OUT/limits.json"  # plain JSON, no RESULT line
echo "results in $OUT"
