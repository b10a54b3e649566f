"""W2 on llama.cpp with prompt-lookup speculative decoding: the peer for `tokenmill bench latency
--speculative-config ...`, driven like ../shared/peers/bench_llama.py (llama-cpp-python's low-level
API, the same W2 prompt ids, greedy by numpy argmax, EOS never checked).

Each step decodes the last token and up to k proposed tokens in one llama_batch, with logits for
all of them; the proposals are kept while each is the argmax before it (greedy verification, as
llama.cpp's own `lookup` example does), and the KV cells of the rejected ones are removed. The
proposals follow tokenmill's n-gram rule (the latest earlier occurrence of the context's last n
tokens, n from --max-ngram down to --min-ngram; the continuation copied on as a shift), so both
engines verify the same proposals and only the engines differ.

Usage: PEERS_SRC=../shared/peers <llama venv>/bin/python benchmarks/llama_lookup_peer.py --gguf F \
           [--num-speculative-tokens 4 --max-ngram 4 --min-ngram 2 --reps 3 --threads 2]
Prints one `RESULT {json}` line (decode tok/s = 255 / (time of the last token - time of the first)).
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

import numpy as np
from llama_cpp import llama_cpp as L

sys.path.insert(0, os.environ.get("PEERS_SRC", "../shared/peers"))
import workload  # noqa: E402


def propose(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        for i in range(total - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                out = list(tokens)
                for _ in range(k):
                    out.append(out[len(out) - (total - i - n)])
                return out[total:]
    return []


ap = argparse.ArgumentParser()
ap.add_argument("--gguf", required=True)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--num-speculative-tokens", type=int, default=4)
ap.add_argument("--max-ngram", type=int, default=4)
ap.add_argument("--min-ngram", type=int, default=2)
args = ap.parse_args()

L.llama_backend_init()
model = L.llama_model_load_from_file(args.gguf.encode(), L.llama_model_default_params())
assert model, "model load failed"
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 512, 512, 512, 1
cp.n_threads = cp.n_threads_batch = args.threads
ctx = L.llama_init_from_model(model, cp)
assert ctx, "context creation failed"
mem = L.llama_get_memory(ctx)
batch = L.llama_batch_init(512, 0, 1)
prompt, n_new = workload.w2_prompt(), workload.W2_NEW_TOKENS


def decode(tokens: list[int], first_pos: int, logits_from: int) -> list[int]:
    """Decode tokens at first_pos..; the argmax after each token from index logits_from on."""
    for i, tok in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, first_pos + i, 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = 1 if i >= logits_from else 0
    batch.n_tokens = len(tokens)
    if L.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")
    return [int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())
            for i in range(logits_from, len(tokens))]


def run(max_new: int, stamps: list[float] | None = None):
    L.llama_memory_clear(mem, True)
    out = decode(prompt, 0, len(prompt) - 1)
    if stamps is not None:
        stamps.append(time.perf_counter())
    drafted = accepted = 0
    while len(out) < max_new:
        context = prompt + out
        k = min(args.num_speculative_tokens, max_new - len(out) - 1)
        drafts = propose(context, args.min_ngram, args.max_ngram, k) if k > 0 else []
        pos = len(context) - 1  # the last token's cell, not decoded yet
        picks = decode([out[-1], *drafts], pos, 0)
        new = [picks[0]]
        for j, d in enumerate(drafts):
            if new[-1] != d:
                break
            new.append(picks[j + 1])
        drafted += len(drafts)
        accepted += len(new) - 1
        L.llama_memory_seq_rm(mem, 0, pos + len(new), -1)  # the rejected proposals' cells
        out += new
        if stamps is not None:
            stamps.extend([time.perf_counter()] * len(new))
    return out[:max_new], drafted, accepted


run(8)  # warm-up (excluded)
ttfts, decs = [], []
for _ in range(args.reps):
    stamps: list[float] = []
    t0 = time.perf_counter()
    out, drafted, accepted = run(n_new, stamps)
    stamps = stamps[:n_new]
    ttfts.append(stamps[0] - t0)
    decs.append((n_new - 1) / (stamps[-1] - stamps[0]))
res = {
    "engine": "llama.cpp (llama-cpp-python low-level API) + prompt lookup",
    "gguf": os.path.basename(args.gguf),
    "threads": args.threads,
    "num_speculative_tokens": args.num_speculative_tokens, "max_ngram": args.max_ngram, "min_ngram": args.min_ngram,
    "workload": "W2",
    "ttft_s": ttfts, "decode_tok_s": decs,
    "ttft_s_median": statistics.median(ttfts), "decode_tok_s_median": statistics.median(decs),
    "decode_tok_s_best": max(decs),
    "spec_num_draft_tokens": drafted, "spec_num_accepted_tokens": accepted,  # of the last repetition
    "sample_first16": out[:16],
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}
L.llama_batch_free(batch)
L.llama_free(ctx)
L.llama_model_free(model)
print("RESULT " + json.dumps(res), flush=True)
