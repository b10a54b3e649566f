"""Host side of the sampler: per-request SamplingParams -> padded numpy SamplingMetadata.

Shapes are kept to a few static variants: R is the caller's padded row count; the token-id
dims (P prompt, O output, B bias) are padded to powers of two (at least 16); `num_logprobs` is
rounded up to one of LOGPROBS_BUCKETS; and `mode` is one of three compile-time variants.
Penalty token ids are only shipped in "random_penalties" mode (otherwise P = O = 16, all -1).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenmill.ops.sampler import SamplingMetadata
from tokenmill.sampling_params import MAX_LOGPROBS, SAMPLING_EPS, SamplingParams

MIN_BUCKET = 16
# Requested top-logprob counts are rounded up to one of these (fewer compiled variants).
LOGPROBS_BUCKETS = (5, MAX_LOGPROBS)


def pad_bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


def round_num_logprobs(n: int | None) -> int | None:
    """None stays None; otherwise the smallest bucket >= n."""
    if n is None:
        return None
    for b in LOGPROBS_BUCKETS:
        if n <= b:
            return b
    raise ValueError(f"logprobs must be <= {MAX_LOGPROBS}, got {n}")


def seed_to_u32(seed: int) -> int:
    """Any Python int (negative or > 32 bits) -> a uint32 key seed, mixing the high bits in."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    return (s ^ (s >> 32)) & 0xFFFFFFFF


def _fill_ids(rows: Sequence[Sequence[int]], num_rows: int, vocab_size: int) -> np.ndarray:
    width = pad_bucket(max((len(r) for r in rows), default=0))
    out = np.full((num_rows, width), -1, np.int32)
    for i, ids in enumerate(rows):
        if len(ids):
            a = np.asarray(ids, np.int64)
            out[i, : len(a)] = np.where((a >= 0) & (a < vocab_size), a, -1)
    return out


def build_sampling_metadata(
    params_list: Sequence[SamplingParams | None],
    steps: Sequence[int],
    seeds: Sequence[int],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    padded_rows: int,
    vocab_size: int,
    *,
    eos_token_ids: Sequence[int] = (),
) -> tuple[SamplingMetadata, str, int | None]:
    """Build the sampler's inputs for one step.

    Row i < len(params_list) is request i (None = a row that is not sampled: greedy, harmless);
    rows beyond are padding. `steps[i]` is the number of tokens request i has generated so far,
    `seeds[i]` its concrete seed (the runner draws one for requests without a seed).
    `output_ids[i]` is used by the penalties and by min_tokens (which forbids the stop tokens,
    `stop_token_ids` plus `eos_token_ids` unless ignore_eos, while fewer than min_tokens tokens
    have been generated, through -inf logit biases, as vLLM does).

    Returns (metadata as numpy arrays, mode, num_logprobs).
    """
    n = len(params_list)
    if padded_rows < n:
        raise ValueError(f"padded_rows={padded_rows} < number of rows {n}")
    for name, seq in (("steps", steps), ("seeds", seeds), ("prompt_ids", prompt_ids),
                      ("output_ids", output_ids)):
        if len(seq) < n:
            raise ValueError(f"{name} has {len(seq)} entries for {n} rows")
    r = padded_rows

    temperature = np.zeros(r, np.float32)
    top_k = np.zeros(r, np.int32)
    top_p = np.ones(r, np.float32)
    min_p = np.zeros(r, np.float32)
    seed_arr = np.zeros(r, np.uint32)
    step_arr = np.zeros(r, np.int32)
    rep = np.ones(r, np.float32)
    pres = np.zeros(r, np.float32)
    freq = np.zeros(r, np.float32)

    any_random = any_penalties = False
    max_logprobs: int | None = None
    biases: list[dict[int, float]] = [{} for _ in range(n)]
    for i, p in enumerate(params_list):
        step_arr[i] = steps[i]
        seed_arr[i] = seed_to_u32(seeds[i])
        if p is None:
            continue
        temperature[i] = p.temperature
        top_k[i] = p.top_k
        top_p[i] = p.top_p
        min_p[i] = p.min_p
        rep[i] = p.repetition_penalty
        pres[i] = p.presence_penalty
        freq[i] = p.frequency_penalty
        any_random |= p.temperature >= SAMPLING_EPS
        any_penalties |= p.uses_penalties
        if p.logprobs is not None:
            max_logprobs = max(max_logprobs or 0, p.logprobs)
        if p.logit_bias:
            biases[i].update((t, b) for t, b in p.logit_bias.items() if t < vocab_size)
        if p.min_tokens and len(output_ids[i]) < p.min_tokens:
            stop_ids = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                stop_ids.update(eos_token_ids)
            for t in stop_ids:
                if 0 <= t < vocab_size:
                    biases[i][t] = -np.inf

    b_width = pad_bucket(max((len(b) for b in biases), default=0))
    bias_ids = np.full((r, b_width), -1, np.int32)
    bias_values = np.zeros((r, b_width), np.float32)
    for i, b in enumerate(biases):
        if b:
            bias_ids[i, : len(b)] = list(b.keys())
            bias_values[i, : len(b)] = list(b.values())
    any_bias = any(biases)

    if any_penalties:
        prompt_arr = _fill_ids(prompt_ids[:n], r, vocab_size)
        output_arr = _fill_ids(output_ids[:n], r, vocab_size)
        mode = "random_penalties"
    else:
        prompt_arr = np.full((r, MIN_BUCKET), -1, np.int32)
        output_arr = np.full((r, MIN_BUCKET), -1, np.int32)
        mode = "random" if (any_random or any_bias) else "greedy"

    md = SamplingMetadata(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=seed_arr,
        steps=step_arr,
        repetition_penalty=rep,
        presence_penalty=pres,
        frequency_penalty=freq,
        prompt_token_ids=prompt_arr,
        output_token_ids=output_arr,
        bias_ids=bias_ids,
        bias_values=bias_values,
    )
    return md, mode, round_num_logprobs(max_logprobs)
