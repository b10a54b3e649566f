#!/usr/bin/env bash
# The fused MoE op at Qwen3-30B-A3B layer shapes (`tokenmill bench moe`), float32 and each quantized
# expert format, one after the other under the bench lock.
# Usage: benchmarks/run_moe_sitting.sh [OUT_DIR] [REPS]    (results: moe_<quant>.json and .log)
set -u
cd "$(dirname "$0")/.."
OUT=${1:-bench_results/moe-$(date +%Y%m%d-%H%M)}
REPS=${2:-7}
mkdir -p "$OUT"
for quant in none int8 fp8_e4m3 fp8_e5m2; do
  flock /tmp/bench.lock .venv/bin/tokenmill bench moe --quant "$quant" --reps "$REPS" \
    --output-json "$OUT/moe_$quant.json" > "$OUT/moe_$quant.log" 2>&1
done
