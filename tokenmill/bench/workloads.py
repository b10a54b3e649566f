"""The benchmark workloads of DESIGN.md, with exactly the token ids the peer drivers use.

Prompt ids are drawn with Python's `random.Random(seed).randrange(LO, HI)` (stable across Python
versions), so tokenmill, vLLM, llama.cpp and transformers see the same prompts. No BOS is added.
"""

from __future__ import annotations

import random

LO, HI = 1000, 49000  # avoids SmolLM2's special tokens and the tail of its 49152-token vocabulary
THROUGHPUT_SEED = 20240601  # W1
LATENCY_SEED = 7  # W2


def random_prompts(num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(LO, HI) for _ in range(input_len)] for _ in range(num_prompts)]
