"""On-device sampler: logits [R, V] -> sampled ids (and requested logprobs), inside jit.

Plain `jnp`, static shapes; greedy rows' argmax by a C++ kernel on CPU (ops/cpu/argmax.py: XLA's
own is a single-threaded scalar reduce). Three compile-time variants (`mode`):

- "greedy": argmax of the raw logits. The fast path when every row is greedy with no penalties
  and no logit bias: no sort, no noise, no penalty scatter.
- "random": logit bias -> (greedy rows: argmax) -> temperature -> min_p -> top_k -> top_p ->
  Gumbel-max draw with the row's own key.
- "random_penalties": as "random", with repetition/presence/frequency penalties applied after
  the logit bias (vLLM's order).

A row's draw depends only on its logits, its parameters, its seed and its step: the key of row r
is fold_in(PRNGKey(seed_r), step_r), and the Gumbel noise is a function of that key alone, so a
request samples the same token whatever batch it is in. Several rows may belong to one request
(speculative verification): give them steps step, step+1, ...

Cost, beyond a few elementwise passes over [R, V]: top-k/top-p (only when some row uses them)
work on each row's TOP_CANDIDATES largest logits (`lax.top_k`), with a full sort only for rows
whose cut-off lies beyond those; the draw needs Gumbel noise for ~2*sqrt(V) entries per row
(two-level Gumbel-max), not V.

Logprobs are vLLM's default "raw" ones: log_softmax of the model's logits before any processing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tokenmill.ops.cpu.argmax import greedy_ids
from tokenmill.sampling_params import MAX_LOGPROBS, SAMPLING_EPS

MODES = ("greedy", "random", "random_penalties")
# top-k/top-p work on this many largest logits per row (a full sort only when not enough).
TOP_CANDIDATES = 1024

__all__ = [
    "MAX_LOGPROBS",
    "MODES",
    "SamplingMetadata",
    "SamplerOutput",
    "sample",
    "compute_prompt_logprobs",
    "apply_logit_bias",
    "apply_penalties",
    "apply_min_p",
    "apply_top_k_top_p",
    "top_k_top_p_cut",
    "top_k_top_p_cut_reference",
    "gumbel_max_sample",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingMetadata:
    """Per-row sampling inputs, all arrays with leading dim R (padded row count)."""

    temperature: jax.Array  # f32[R]; < 1e-5 => greedy row
    top_k: jax.Array  # i32[R]; 0 => off
    top_p: jax.Array  # f32[R]; 1 => off
    min_p: jax.Array  # f32[R]; 0 => off
    seeds: jax.Array  # u32[R]
    steps: jax.Array  # i32[R]; tokens generated so far by the row's request
    repetition_penalty: jax.Array  # f32[R]; 1 => off
    presence_penalty: jax.Array  # f32[R]; 0 => off
    frequency_penalty: jax.Array  # f32[R]; 0 => off
    prompt_token_ids: jax.Array  # i32[R, P]; -1 padded
    output_token_ids: jax.Array  # i32[R, O]; -1 padded
    bias_ids: jax.Array  # i32[R, B]; -1 padded
    bias_values: jax.Array  # f32[R, B]

    def replace(self, **changes) -> SamplingMetadata:
        return dataclasses.replace(self, **changes)


class SamplerOutput(NamedTuple):
    sampled: jax.Array  # i32[R]
    logprobs: jax.Array | None = None  # f32[R, 1+K]: col 0 = sampled token, then top-K
    logprob_ids: jax.Array | None = None  # i32[R, 1+K]
    sampled_rank: jax.Array | None = None  # i32[R]; 1 = most likely (vLLM's rank)


# ----------------------------------------------------------------------------- logits processing


def _scatter_ids(ids: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """Row indices and column indices for a scatter, with -1 padding sent out of bounds."""
    rows = jnp.broadcast_to(jnp.arange(ids.shape[0], dtype=jnp.int32)[:, None], ids.shape)
    cols = jnp.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)
    return rows, cols


def apply_logit_bias(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """logits[r, bias_ids[r, j]] += bias_values[r, j] (ids must be unique per row)."""
    rows, cols = _scatter_ids(md.bias_ids, logits.shape[1])
    return logits.at[rows, cols].add(md.bias_values.astype(logits.dtype), mode="drop")


def apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """vLLM's penalties: repetition over prompt+output tokens, presence/frequency over output.

    repetition: logit / rp if logit > 0 else logit * rp, for tokens seen in prompt or output.
    frequency/presence: logit -= freq * count_in_output + pres * (count_in_output > 0).
    """
    r, v = logits.shape
    prow, pcol = _scatter_ids(md.prompt_token_ids, v)
    orow, ocol = _scatter_ids(md.output_token_ids, v)
    counts = jnp.zeros((r, v), jnp.int32).at[orow, ocol].add(1, mode="drop")
    in_output = counts > 0
    in_prompt = jnp.zeros((r, v), jnp.bool_).at[prow, pcol].set(True, mode="drop")
    rp = md.repetition_penalty[:, None].astype(logits.dtype)
    seen = in_prompt | in_output
    penalised = jnp.where(logits > 0, logits / rp, logits * rp)
    logits = jnp.where(seen, penalised, logits)
    logits = logits - md.frequency_penalty[:, None] * counts.astype(logits.dtype)
    logits = logits - md.presence_penalty[:, None] * in_output.astype(logits.dtype)
    return logits


def apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Drop tokens with prob < min_p * max_prob (computed in log space: no softmax needed)."""
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    # min_p = 0 -> log(0) = -inf -> nothing dropped.
    threshold = row_max + jnp.log(min_p.astype(logits.dtype))[:, None]
    return jnp.where(logits < threshold, -jnp.inf, logits)


def _kth_largest(sorted_desc: jax.Array, top_k: jax.Array, k_off: jax.Array) -> jax.Array:
    """kth largest value [R, 1] from rows sorted descending; -inf where top-k is off.
    (`sorted_desc` may hold only a row's largest values: k is clipped to what it holds.)"""
    k = jnp.clip(top_k, 1, sorted_desc.shape[-1])
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    return jnp.where(k_off[:, None], -jnp.inf, kth)


def _top_k_off(top_k: jax.Array, vocab_size: int) -> jax.Array:
    return (top_k <= 0) | (top_k >= vocab_size)


def _top_p_cut(
    sorted_k: jax.Array, lse: jax.Array, top_p: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Smallest kept value [R, 1] under top_p, given rows sorted descending (top-k already
    applied as -inf) and the log-normaliser `lse` [R, 1] of the whole (top-k masked) row."""
    probs = jnp.exp(sorted_k - lse)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p[:, None]) & (sorted_k > -jnp.inf)
    num_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    cut = jnp.take_along_axis(sorted_k, (num_keep - 1)[:, None], axis=-1)
    return jnp.where(top_p[:, None] >= 1.0, -jnp.inf, cut), num_keep


def top_k_top_p_cut_reference(
    logits: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """The cut-off [R, 1] of top-k then top-p, by one full descending sort per row.

    Tokens with logit >= cut are kept; ties at a cut-off are all kept. A token is kept by top_p
    when the mass of the strictly more likely tokens is < top_p: vLLM's rule (it always keeps at
    least one token). The plain reference, and the fallback of `top_k_top_p_cut`.
    """
    sorted_desc = -jnp.sort(-logits, axis=-1)
    kth = _kth_largest(sorted_desc, top_k, _top_k_off(top_k, logits.shape[-1]))
    sorted_k = jnp.where(sorted_desc >= kth, sorted_desc, -jnp.inf)
    lse = jax.nn.logsumexp(sorted_k, axis=-1, keepdims=True)
    p_cut, _ = _top_p_cut(sorted_k, lse, top_p)
    return jnp.maximum(kth, p_cut)


def top_k_top_p_cut(
    logits: jax.Array, top_k: jax.Array, top_p: jax.Array, num_candidates: int = TOP_CANDIDATES
) -> jax.Array:
    """As `top_k_top_p_cut_reference`, without sorting the whole vocabulary.

    Works on the row's `num_candidates` largest logits (`lax.top_k`) plus one pass over the row
    for the normaliser. A row whose cut-off may lie beyond the candidates (top_k > candidates,
    or a top_p nucleus of more than that many tokens) takes the full-sort result instead, decided
    per row, so a row's result never depends on the other rows.
    """
    v = logits.shape[-1]
    c = min(num_candidates, v)
    cand, _ = jax.lax.top_k(logits, c)  # [R, c], descending
    k_off = _top_k_off(top_k, v)
    kth = _kth_largest(cand, top_k, k_off)
    # kth from the candidates is exact when k <= c; else the row falls back.
    lse = jax.nn.logsumexp(jnp.where(logits >= kth, logits, -jnp.inf), axis=-1, keepdims=True)
    cand_k = jnp.where(cand >= kth, cand, -jnp.inf)
    p_cut, num_keep = _top_p_cut(cand_k, lse, top_p)
    cut = jnp.maximum(kth, p_cut)
    if c == v:
        return cut
    fallback = (~k_off & (top_k > c)) | (k_off & (top_p < 1.0) & (num_keep >= c))
    return jax.lax.cond(
        jnp.any(fallback),
        lambda: jnp.where(fallback[:, None], top_k_top_p_cut_reference(logits, top_k, top_p), cut),
        lambda: cut,
    )


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keep the top_k highest logits (0 = all), then the smallest set of those whose
    probability mass reaches top_p (1 = all); the others become -inf."""
    return jnp.where(logits < top_k_top_p_cut(logits, top_k, top_p), -jnp.inf, logits)


def _row_keys(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """Key of row r: fold_in(PRNGKey(seed_r), step_r)."""
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(
        seeds.astype(jnp.uint32), steps.astype(jnp.uint32)
    )


def gumbel_max_sample(x: jax.Array, seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """Draw one token per row from softmax(x) (-inf = excluded), with the row's own key.

    Gumbel-max in two levels, which is exactly the same distribution as one argmax of x plus
    Gumbel noise over the whole vocabulary, with noise for about 2*sqrt(V) entries instead of V:
    the vocabulary is cut into blocks of B; a block is drawn by Gumbel-max over the blocks'
    log-sum-exps, then a token inside it by Gumbel-max over its logits.
    """
    r, v = x.shape
    b = 1 << max(0, math.ceil(math.log2(math.sqrt(v))))  # block size, a power of two
    nb = -(-v // b)
    xb = jnp.pad(x, ((0, 0), (0, nb * b - v)), constant_values=-jnp.inf).reshape(r, nb, b)
    m = jnp.max(xb, axis=-1)
    finite = m > -jnp.inf
    m_safe = jnp.where(finite, m, 0.0)
    block_lse = jnp.where(
        finite, m_safe + jnp.log(jnp.sum(jnp.exp(xb - m_safe[..., None]), axis=-1)), -jnp.inf
    )
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (nb + b,), jnp.float32))(
        _row_keys(seeds, steps)
    )
    g_block, g_tok = noise[:, :nb], noise[:, nb:]
    blk = jnp.argmax(block_lse + g_block, axis=-1)
    inside = jnp.take_along_axis(xb, blk[:, None, None], axis=1)[:, 0, :]
    tok = jnp.argmax(inside + g_tok, axis=-1)
    return (blk * b + tok).astype(jnp.int32)


def _random_sample(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """temperature -> min_p -> top_k -> top_p -> Gumbel-max. `logits` already processed."""
    v = logits.shape[-1]
    temp = md.temperature.astype(jnp.float32)
    is_greedy = temp < SAMPLING_EPS
    greedy = greedy_ids(logits)

    x = logits / jnp.where(is_greedy, 1.0, temp)[:, None]
    x = apply_min_p(x, jnp.where(is_greedy, 0.0, md.min_p))
    top_k = jnp.where(is_greedy, 0, md.top_k)
    top_p = jnp.where(is_greedy, 1.0, md.top_p).astype(jnp.float32)
    # A row without top-k/top-p is left unchanged by the filter, so skipping it for a batch
    # where no row uses it changes nothing.
    any_filter = jnp.any(((top_k > 0) & (top_k < v)) | (top_p < 1.0))
    x = jax.lax.cond(any_filter, apply_top_k_top_p, lambda x, k, p: x, x, top_k, top_p)

    random_ids = gumbel_max_sample(x, md.seeds, md.steps)
    return jnp.where(is_greedy, greedy, random_ids)


# ----------------------------------------------------------------------------- logprobs


def _gather_logprobs(
    logprobs: jax.Array, token_ids: jax.Array, num_logprobs: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[T, 1+K] logprobs and ids (col 0 = token_ids, then top-K descending) and vLLM ranks."""
    token_ids = token_ids.astype(jnp.int32)
    tok_lp = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)  # [T, 1]
    # vLLM's rank: how many tokens have a logprob >= the token's own (1 = the most likely).
    rank = jnp.sum(logprobs >= tok_lp, axis=-1).astype(jnp.int32)
    if num_logprobs > 0:
        top_lp, top_ids = jax.lax.top_k(logprobs, num_logprobs)
        lps = jnp.concatenate([tok_lp, top_lp], axis=-1)
        ids = jnp.concatenate([token_ids[:, None], top_ids.astype(jnp.int32)], axis=-1)
    else:
        lps, ids = tok_lp, token_ids[:, None]
    return lps, ids, rank


def compute_prompt_logprobs(
    logits: jax.Array, target_ids: jax.Array, num_logprobs: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Prompt logprobs: logits[t] predicts target_ids[t] (the next prompt token).

    Returns (logprobs f32[T, 1+K], ids i32[T, 1+K], ranks i32[T]); column 0 is the target.
    """
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return _gather_logprobs(lp, target_ids, num_logprobs)


# ----------------------------------------------------------------------------- entry point


def sample(
    logits: jax.Array, md: SamplingMetadata, *, mode: str, num_logprobs: int | None
) -> SamplerOutput:
    """Sample one token per row. `mode` and `num_logprobs` are static (jit them as such)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if num_logprobs is not None and not 0 <= num_logprobs <= logits.shape[-1]:
        raise ValueError(f"num_logprobs must be in [0, vocab], got {num_logprobs}")
    logits = logits.astype(jnp.float32)

    if mode == "greedy":
        sampled = greedy_ids(logits)
    else:
        processed = apply_logit_bias(logits, md)
        if mode == "random_penalties":
            processed = apply_penalties(processed, md)
        sampled = _random_sample(processed, md)

    if num_logprobs is None:
        return SamplerOutput(sampled)
    raw_lp = jax.nn.log_softmax(logits, axis=-1)
    lps, ids, rank = _gather_logprobs(raw_lp, sampled, num_logprobs)
    return SamplerOutput(sampled, lps, ids, rank)
