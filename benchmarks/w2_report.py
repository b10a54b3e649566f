"""Print the table of a benchmarks/run_w2_rounds.sh folder as Markdown: W2 decode tok/s (median of each
run's repetitions) of tokenmill and llama.cpp at each precision, round by round, their ratio, and the
median ratio against target 3's (1.3x F32, 1.2x Q8_0, 1.0x Q4_1). llama.cpp keeps its KV cache in F16 at every
precision (its default); fp32kv16 is tokenmill's float32 with a bfloat16 cache, the same bytes."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

PRECISIONS = {  # ours, theirs, target ratio
    "fp32": ("float32", "F32", 1.3),
    "fp32kv16": ("float32, bfloat16 KV cache", "F32", 1.3),
    "int8": ("w8a16_int", "Q8_0", 1.2),
    "q4": ("Q4_1 kept (gguf_int)", "Q4_1", 1.0),
}


def main(folder: str) -> None:
    runs: dict[tuple[str, str], dict[int, float]] = {}
    for path in Path(folder).glob("*-r*.json"):
        m = re.fullmatch(r"(tokenmill|llama)-(fp32kv16|fp32|int8|q4)-r(\d+)\.json", path.name)
        if m is None:
            continue
        try:
            runs.setdefault((m[1], m[2]), {})[int(m[3])] = json.loads(path.read_text())["decode_tok_s_median"]
        except (ValueError, KeyError):
            continue  # a run that printed no result
    print("| precision | round | tokenmill tok/s | llama.cpp tok/s | ratio |")
    print("|---|---|---|---|---|")
    for key, (ours_name, theirs_name, target) in PRECISIONS.items():
        ours, theirs = runs.get(("tokenmill", key), {}), runs.get(("llama", key), {})
        ratios = []
        for r in sorted(set(ours) & set(theirs)):
            ratios.append(ours[r] / theirs[r])
            print(f"| {ours_name} / {theirs_name} | {r} | {ours[r]:.1f} | {theirs[r]:.1f} | {ratios[-1]:.2f}x |")
        if ratios:
            met = sum(x >= target for x in ratios)
            print(f"| {ours_name} / {theirs_name} | median ({met} of {len(ratios)} rounds at {target}x or more) | "
                  f"{statistics.median(ours.values()):.1f} | {statistics.median(theirs.values()):.1f} | "
                  f"**{statistics.median(ratios):.2f}x** |")


if __name__ == "__main__":
    main(sys.argv[1])
