"""Print the table of a benchmarks/run_spec_rounds.sh folder as Markdown: W2 float32 decode tok/s
(median of each run's repetitions) of tokenmill and llama.cpp, round by round, and their ratio."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path


def main(folder: str) -> None:
    runs: dict[tuple[str, str], dict[int, dict]] = {}
    for path in Path(folder).glob("*-r*.json"):
        m = re.fullmatch(r"(tokenmill|llama)-(plain|spec\d+)-r(\d+)\.json", path.name)
        if m is None:
            continue
        try:
            runs.setdefault((m[1], m[2]), {})[int(m[3])] = json.loads(path.read_text())
        except ValueError:
            continue  # a run that printed no result
    configs = sorted({c for _, c in runs}, key=lambda c: (c != "plain", int(c[4:] or 0) if c != "plain" else 0))
    print("| decoding | round | tokenmill tok/s | llama.cpp F32 tok/s | ratio | proposals accepted (tokenmill, llama.cpp) |")
    print("|---|---|---|---|---|---|")
    for config in configs:
        ours, theirs = runs.get(("tokenmill", config), {}), runs.get(("llama", config), {})
        ratios = []
        for r in sorted(set(ours) & set(theirs)):
            a, b = ours[r]["decode_tok_s_median"], theirs[r]["decode_tok_s_median"]
            ratios.append(a / b)
            accepted = "–" if config == "plain" else ", ".join(
                f"{run['spec_num_accepted_tokens']} / {run['spec_num_draft_tokens']}" for run in (ours[r], theirs[r]))
            label = "plain" if config == "plain" else f"n-gram, k={config[4:]}"
            print(f"| {label} | {r} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {accepted} |")
        if ratios:
            print(f"| | median | | | **{statistics.median(ratios):.2f}x** | |")


if __name__ == "__main__":
    main(sys.argv[1])
