"""The on-device sampler (tokenmill/ops/sampler.py) and its host-side metadata builder.

Everything goes through `jax.jit(sample, static_argnames=...)`, as the model runner calls it.
Tiny vocabularies and fixed seeds keep it fast and deterministic.
"""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenmill.ops.sampler import (
    MAX_LOGPROBS,
    SamplingMetadata,
    apply_logit_bias,
    apply_penalties,
    TOP_CANDIDATES,
    compute_prompt_logprobs,
    sample,
    top_k_top_p_cut,
    top_k_top_p_cut_reference,
)
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.sampling_metadata import (
    build_sampling_metadata,
    pad_bucket,
    round_num_logprobs,
    seed_to_u32,
)

sample_jit = jax.jit(sample, static_argnames=("mode", "num_logprobs"))
prompt_logprobs_jit = jax.jit(compute_prompt_logprobs, static_argnames=("num_logprobs",))
penalties_jit = jax.jit(lambda logits, md: apply_penalties(apply_logit_bias(logits, md), md))

# Chi-square critical values at p = 1e-4, by degrees of freedom (scipy.stats.chi2.isf(1e-4, d)).
_CHI2_CRIT_1E4 = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513, 5: 25.745, 6: 27.856, 7: 29.878,
                  8: 31.828, 9: 33.72}


def chi2_critical(dof: int) -> float:
    try:
        from scipy.stats import chi2
    except ImportError:
        return _CHI2_CRIT_1E4[dof]
    return float(chi2.isf(1e-4, dof))


def make_md(r: int, *, width: int = 16, **kw) -> SamplingMetadata:
    """Neutral metadata for r rows (greedy, no penalties, no bias), fields overridable."""

    def row(name, default, dtype):
        v = kw.pop(name, default)
        return np.broadcast_to(np.asarray(v, dtype), (r,)).copy()

    def mat(name, default, dtype):
        v = kw.pop(name, None)
        if v is None:
            return np.full((r, width), default, dtype)
        out = np.full((r, width), default, dtype)
        for i, vals in enumerate(v):
            out[i, : len(vals)] = vals
        return out

    md = SamplingMetadata(
        temperature=row("temperature", 0.0, np.float32),
        top_k=row("top_k", 0, np.int32),
        top_p=row("top_p", 1.0, np.float32),
        min_p=row("min_p", 0.0, np.float32),
        seeds=row("seeds", 0, np.uint32),
        steps=row("steps", 0, np.int32),
        repetition_penalty=row("repetition_penalty", 1.0, np.float32),
        presence_penalty=row("presence_penalty", 0.0, np.float32),
        frequency_penalty=row("frequency_penalty", 0.0, np.float32),
        prompt_token_ids=mat("prompt_token_ids", -1, np.int32),
        output_token_ids=mat("output_token_ids", -1, np.int32),
        bias_ids=mat("bias_ids", -1, np.int32),
        bias_values=mat("bias_values", 0.0, np.float32),
    )
    assert not kw, f"unknown fields {kw}"
    return md


def rand_logits(r: int, v: int, seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(r, v)) * scale).astype(np.float32)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# --------------------------------------------------------------------- numpy reference (vLLM)


def ref_process(logits, prompt, output, rep, pres, freq, bias):
    """vLLM's logit bias then penalties, one row, written plainly."""
    x = logits.astype(np.float64).copy()
    for t, b in bias.items():
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t, c in Counter(output).items():
        x[t] -= freq * c + pres
    return x


def ref_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM's sampling distribution: temperature -> min_p -> top_k -> top_p (ascending-sort
    formulation, as vLLM's apply_top_k_top_p), one row."""
    x = logits.astype(np.float64) / temperature
    if min_p > 0:
        p = np.exp(log_softmax(x))
        x = np.where(p < min_p * p.max(), -np.inf, x)
    order = np.argsort(x, kind="stable")  # ascending
    xs = x[order]
    v = len(x)
    if 0 < top_k < v:
        xs = np.where(xs < xs[v - top_k], -np.inf, xs)
    if top_p < 1.0:
        ps = np.exp(log_softmax(xs))
        drop = np.cumsum(ps) <= 1 - top_p
        drop[-1] = False
        xs = np.where(drop, -np.inf, xs)
    out = np.empty_like(xs)
    out[order] = xs
    return np.exp(log_softmax(out))


def draw(logits_row, n, seed0=0, mode="random", **params):
    """n draws of one row (seed varies per draw, vectorised into one call)."""
    v = len(logits_row)
    logits = np.broadcast_to(logits_row, (n, v)).astype(np.float32)
    params.setdefault("temperature", 1.0)
    md = make_md(n, seeds=np.arange(seed0, seed0 + n), steps=np.arange(n) % 7, **params)
    return np.asarray(sample_jit(logits, md, mode=mode, num_logprobs=None).sampled)


def assert_matches_distribution(samples, probs):
    v = len(probs)
    counts = np.bincount(samples, minlength=v)
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew outside the support: {counts} vs {probs}"
    n = len(samples)
    expected = n * probs[support]
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    if dof == 0:
        return
    assert stat < chi2_critical(dof), f"chi2={stat:.2f} dof={dof} counts={counts} p={probs}"


# Most tests share these shapes, so that the jitted sampler compiles only a few variants.
R, V = 8, 64
N_DRAWS = 20000  # distribution tests: N_DRAWS rows over a vocab of 8
# Distinct, well-separated probabilities so that no filter sits on a cut-off.
P8 = np.array([0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.03, 0.02])
L8 = np.log(P8).astype(np.float32) + 1.5  # an offset: logits need not be normalised
L10 = np.random.default_rng(12).normal(size=10).astype(np.float32)


# --------------------------------------------------------------------- greedy


def test_greedy_mode_is_argmax():
    logits = rand_logits(R, V)
    out = sample_jit(logits, make_md(R), mode="greedy", num_logprobs=None)
    np.testing.assert_array_equal(out.sampled, logits.argmax(-1))
    assert out.sampled.dtype == jnp.int32 and out.logprobs is None


def test_greedy_mode_ignores_other_params():
    logits = rand_logits(R, V)
    md = make_md(R, temperature=1.0, top_k=3, bias_ids=[[0]] * R, bias_values=[[100.0]] * R)
    out = sample_jit(logits, md, mode="greedy", num_logprobs=None)
    np.testing.assert_array_equal(out.sampled, logits.argmax(-1))


def test_top_k_1_equals_greedy():
    for seed in range(4):
        logits = rand_logits(R, V, seed=seed)
        md = make_md(R, temperature=1.5, top_k=1, seeds=np.arange(R) + 10 * seed,
                     steps=np.arange(R))
        out = sample_jit(logits, md, mode="random", num_logprobs=None)
        np.testing.assert_array_equal(out.sampled, logits.argmax(-1))


def test_temperature_zero_rows_in_random_batch_are_greedy():
    r, v = R, V
    logits = rand_logits(r, v, seed=2, scale=0.3)  # flat: random rows rarely hit the argmax
    temp = np.where(np.arange(r) % 2 == 0, 0.0, 5.0)
    md = make_md(r, temperature=temp, top_p=0.99, min_p=0.01, seeds=np.arange(r))
    for mode in ("random", "random_penalties"):
        got = np.asarray(sample_jit(logits, md, mode=mode, num_logprobs=None).sampled)
        np.testing.assert_array_equal(got[::2], logits.argmax(-1)[::2])
        assert (got[1::2] != logits.argmax(-1)[1::2]).any()


# --------------------------------------------------------------------- determinism


def test_same_seed_and_step_same_token_alone_or_in_batch():
    v = V
    target = rand_logits(1, v, seed=3, scale=1.0)[0]
    others = rand_logits(R - 1, v, seed=4)
    for seed, step in [(0, 0), (1, 0), (1, 1), (12345, 77), (2**32 - 1, 3)]:
        alone = make_md(1, temperature=0.9, seeds=seed, steps=step)
        a = sample_jit(target[None], alone, mode="random", num_logprobs=None).sampled[0]
        # The same row among others with different logits, params (including a top-k/top-p
        # row, which turns on the sort path for the whole batch), seeds and steps.
        logits = np.concatenate([others[:2], target[None], others[2:]])
        batch = make_md(
            R,
            temperature=[0.5, 0.0, 0.9, 2.0, 1.0, 0.7, 0.0, 0.0],
            top_k=[3, 0, 0, 0, 5, 0, 0, 0],
            top_p=[1.0, 1.0, 1.0, 0.5, 1.0, 0.9, 1.0, 1.0],
            min_p=[0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.0],
            seeds=[seed, 9, seed, 5, 6, 7, 0, 0],
            steps=[step + 1, 2, step, 4, 5, 6, 0, 0],
        )
        b = sample_jit(logits, batch, mode="random", num_logprobs=None).sampled[2]
        p = sample_jit(logits, batch, mode="random_penalties", num_logprobs=0).sampled[2]
        assert int(a) == int(b) == int(p), (seed, step)


def test_steps_and_seeds_change_the_draw():
    n, v = N_DRAWS, 8
    logits = np.zeros((n, v), np.float32)  # uniform
    runs = {
        "by_step": make_md(n, temperature=1.0, seeds=7, steps=np.arange(n)),
        "by_seed": make_md(n, temperature=1.0, seeds=np.arange(n), steps=3),
        "same": make_md(n, temperature=1.0, seeds=7, steps=3),
    }
    got = {k: np.asarray(sample_jit(logits, md, mode="random", num_logprobs=None).sampled)
           for k, md in runs.items()}
    uniform = np.full(v, 1.0 / v)
    assert_matches_distribution(got["by_step"], uniform)
    assert_matches_distribution(got["by_seed"], uniform)
    assert len(set(got["same"].tolist())) == 1


# --------------------------------------------------------------------- distributions


def test_frequencies_match_softmax_with_temperature():
    samples = draw(L8, N_DRAWS, temperature=0.7)
    assert_matches_distribution(samples, ref_distribution(L8, temperature=0.7))


@pytest.mark.parametrize(
    "params, support",
    [
        (dict(top_k=3), 3),
        (dict(top_k=5, temperature=2.0), 5),
        (dict(top_p=0.7), 4),  # mass before the 5th token is 0.77 >= 0.7
        (dict(top_p=0.25), 1),
        (dict(min_p=0.3), 5),  # keep p >= 0.09
        (dict(min_p=0.5, temperature=0.8), None),
        (dict(top_k=4, top_p=0.5), 2),  # top_p on the top-4, renormalised
        (dict(min_p=0.2, top_k=6, top_p=0.85, temperature=1.3), None),
    ],
)
def test_filters_restrict_support_and_renormalise(params, support):
    probs = ref_distribution(L8, **params)
    if support is not None:
        assert (probs > 0).sum() == support  # the reference itself agrees with the comment
    samples = draw(L8, N_DRAWS, seed0=1000, **params)
    assert_matches_distribution(samples, probs)


def test_filters_shuffled_vocab_and_many_rows():
    # Same distributions with the vocab permuted per row: the filters work on values, not ids.
    rng = np.random.default_rng(5)
    perms = [rng.permutation(8) for _ in range(3)]
    for perm, params in zip(perms, [dict(top_k=2), dict(top_p=0.6), dict(min_p=0.45)]):
        row = L8[perm]
        samples = draw(row, N_DRAWS, seed0=77, **params)
        assert_matches_distribution(samples, ref_distribution(row, **params))


def test_frequencies_match_softmax_vocab_not_a_multiple_of_the_block():
    # V=10: the two-level draw uses blocks of 4, the last one padded. (Neutral penalties mode:
    # the same compiled variant as the next test.)
    row = L10
    samples = draw(row, N_DRAWS, seed0=5, mode="random_penalties")
    assert_matches_distribution(samples, ref_distribution(row))
    samples = draw(row, N_DRAWS, seed0=6, mode="random_penalties", top_k=9)  # drops 1 token
    assert_matches_distribution(samples, ref_distribution(row, top_k=9))


cut_jit = jax.jit(top_k_top_p_cut, static_argnames=("num_candidates",))
cut_ref_jit = jax.jit(top_k_top_p_cut_reference)


@pytest.mark.parametrize("scale", [0.2, 1.0, 5.0])
def test_candidate_top_k_top_p_equals_full_sort(scale):
    # 8 candidates out of 64: rows whose cut-off lies beyond them fall back to the full sort.
    n, v = 64, V
    rng = np.random.default_rng(int(scale * 10))
    logits = (rng.normal(size=(n, v)) * scale).astype(np.float32)
    logits[::5] = np.round(logits[::5])  # ties
    top_k = rng.choice([0, 1, 2, 7, 8, 9, 30, 63, 64, 100], n).astype(np.int32)
    top_p = rng.choice([1.0, 0.99, 0.9, 0.5, 0.2, 0.05], n).astype(np.float32)
    ref = np.asarray(cut_ref_jit(logits, top_k, top_p))
    for c in (8, TOP_CANDIDATES):
        got = np.asarray(cut_jit(logits, top_k, top_p, num_candidates=c))
        np.testing.assert_array_equal(logits >= got, logits >= ref)
    # The masks agree with the plain numpy reference of vLLM's rule.
    for i in range(n):
        probs = ref_distribution(logits[i], top_k=int(top_k[i]), top_p=float(top_p[i]))
        if not (logits[i] == np.round(logits[i])).all():  # numpy's sort splits ties
            np.testing.assert_array_equal(probs > 0, logits[i] >= ref[i])


# --------------------------------------------------------------------- penalties and bias


def _penalty_case(r=R, v=V, seed=6):
    rng = np.random.default_rng(seed)
    logits = rand_logits(r, v, seed=seed)
    prompts = [rng.integers(0, v, rng.integers(0, 12)).tolist() for _ in range(r)]
    outputs = [rng.integers(0, v, rng.integers(0, 14)).tolist() for _ in range(r)]
    rep = rng.uniform(0.5, 2.0, r)
    pres = rng.uniform(-2, 2, r)
    freq = rng.uniform(-2, 2, r)
    biases = [
        {int(t): float(b) for t, b in zip(rng.choice(v, 3, replace=False), rng.uniform(-5, 5, 3))}
        for _ in range(r)
    ]
    md = make_md(
        r,
        repetition_penalty=rep,
        presence_penalty=pres,
        frequency_penalty=freq,
        prompt_token_ids=prompts,
        output_token_ids=outputs,
        bias_ids=[list(b) for b in biases],
        bias_values=[list(b.values()) for b in biases],
    )
    ref = np.stack([
        ref_process(logits[i], prompts[i], outputs[i], rep[i], pres[i], freq[i], biases[i])
        for i in range(r)
    ])
    return logits, md, ref


def test_penalties_and_bias_match_vllm_definition():
    logits, md, ref = _penalty_case()
    got = np.asarray(penalties_jit(logits, md))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_greedy_rows_use_processed_logits():
    logits, md, ref = _penalty_case(seed=7)
    got = sample_jit(logits, md, mode="random_penalties", num_logprobs=None).sampled
    np.testing.assert_array_equal(got, ref.argmax(-1))


def test_strong_bias_forbids_and_forces():
    n = N_DRAWS
    logits = np.broadcast_to(L8, (n, 8))
    top = int(L8.argmax())
    forbid = make_md(n, temperature=1.0, seeds=np.arange(n),
                     bias_ids=[[top]] * n, bias_values=[[-100.0]] * n)
    got = np.asarray(sample_jit(logits, forbid, mode="random", num_logprobs=None).sampled)
    assert top not in got and len(set(got.tolist())) > 3
    force = make_md(n, temperature=1.0, seeds=np.arange(n),
                    bias_ids=[[7]] * n, bias_values=[[100.0]] * n)
    got = np.asarray(sample_jit(logits, force, mode="random", num_logprobs=None).sampled)
    assert (got == 7).all()


def test_penalties_shift_the_distribution():
    # Presence penalty 2 on the top token, sampled at T=1, matches the reference distribution.
    top = int(L10.argmax())
    md_kw = dict(presence_penalty=2.0, frequency_penalty=0.5, repetition_penalty=1.3,
                 output_token_ids=[[top, top, 3]] * N_DRAWS, prompt_token_ids=[[1]] * N_DRAWS)
    logits = np.broadcast_to(L10, (N_DRAWS, 10))
    md = make_md(N_DRAWS, temperature=1.0, seeds=np.arange(N_DRAWS), **md_kw)
    got = np.asarray(sample_jit(logits, md, mode="random_penalties", num_logprobs=None).sampled)
    processed = ref_process(L10, [1], [top, top, 3], 1.3, 2.0, 0.5, {})
    assert_matches_distribution(got, ref_distribution(processed))


# --------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("mode, k", [("greedy", MAX_LOGPROBS), ("random", 5),
                                     ("random_penalties", 0)])
def test_logprobs_are_raw_and_correct(mode, k):
    logits, md, _ = _penalty_case(seed=8)
    md = md.replace(temperature=np.where(np.arange(R) < 2, 0.0, 1.0).astype(np.float32),
                    seeds=np.arange(R, dtype=np.uint32))
    out = sample_jit(logits, md, mode=mode, num_logprobs=k)
    ids = np.asarray(out.sampled)
    rows = np.arange(R)
    lp = log_softmax(logits)  # raw: before bias, penalties, temperature
    assert out.logprobs.shape == (R, 1 + k) and out.logprob_ids.shape == (R, 1 + k)
    np.testing.assert_array_equal(out.logprob_ids[:, 0], ids)
    np.testing.assert_allclose(out.logprobs[:, 0], lp[rows, ids], rtol=1e-5, atol=1e-5)
    if k:
        top = np.argsort(-lp, axis=-1)[:, :k]
        np.testing.assert_array_equal(out.logprob_ids[:, 1:], top)
        np.testing.assert_allclose(out.logprobs[:, 1:], np.take_along_axis(lp, top, -1),
                                   rtol=1e-5, atol=1e-5)
    ranks = (lp >= lp[rows, ids][:, None]).sum(-1)
    np.testing.assert_array_equal(out.sampled_rank, ranks)
    if mode == "greedy":
        np.testing.assert_array_equal(out.sampled_rank, 1)
    else:
        assert (ranks > 1).any()  # some rows really sampled, away from the argmax


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs(k):
    t, v = 10, 30
    logits = rand_logits(t, v, seed=10)
    targets = np.random.default_rng(10).integers(0, v, t).astype(np.int32)
    lps, ids, ranks = prompt_logprobs_jit(logits, targets, num_logprobs=k)
    lp = log_softmax(logits)
    assert lps.shape == (t, 1 + k)
    np.testing.assert_array_equal(ids[:, 0], targets)
    np.testing.assert_allclose(lps[:, 0], lp[np.arange(t), targets], rtol=1e-5, atol=1e-5)
    if k:
        top = np.argsort(-lp, axis=-1)[:, :k]
        np.testing.assert_array_equal(ids[:, 1:], top)
        np.testing.assert_allclose(lps[:, 1:], np.take_along_axis(lp, top, -1), atol=1e-5)
    np.testing.assert_array_equal(ranks, (lp >= lp[np.arange(t), targets][:, None]).sum(-1))


# --------------------------------------------------------------------- host-side builder


def _build(params, outputs=None, prompts=None, rows=8, vocab=50, **kw):
    n = len(params)
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    prompts = prompts if prompts is not None else [[1, 2, 3] for _ in range(n)]
    steps = [len(o) for o in outputs]
    return build_sampling_metadata(params, steps, list(range(100, 100 + n)), prompts, outputs,
                                   rows, vocab, **kw)


def test_builder_modes_and_logprob_buckets():
    g = SamplingParams(temperature=0.0)
    assert _build([g, g, None])[1:] == ("greedy", None)
    assert _build([g, SamplingParams()])[1:] == ("random", None)
    assert _build([g, SamplingParams(temperature=0, logit_bias={3: 1.0})])[1] == "random"
    assert _build([g, SamplingParams(temperature=0, presence_penalty=0.5)])[1] == (
        "random_penalties")
    assert _build([SamplingParams(logprobs=0)])[2] == 5
    assert _build([SamplingParams(logprobs=3), SamplingParams(logprobs=6)])[2] == 20
    assert [round_num_logprobs(x) for x in (None, 0, 5, 6, 20)] == [None, 5, 5, 20, 20]
    assert [pad_bucket(x) for x in (0, 1, 16, 17, 100)] == [16, 16, 16, 32, 128]
    assert seed_to_u32(-1) == 0 and 0 <= seed_to_u32(2**70 + 5) < 2**32


def test_builder_shapes_padding_and_values():
    ps = [SamplingParams(temperature=0.5, top_k=-1, top_p=0.9, min_p=0.1,
                         repetition_penalty=1.2, logit_bias={1: 2.0, 99: 5.0}),
          None]
    md, mode, _ = _build(ps, outputs=[[4] * 20, []], prompts=[[1] * 40, [2]], rows=4, vocab=50)
    assert mode == "random_penalties"
    assert md.temperature.shape == (4,) and md.temperature.dtype == np.float32
    assert md.prompt_token_ids.shape == (4, 64) and md.output_token_ids.shape == (4, 32)
    assert md.bias_ids.shape == (4, 16)
    np.testing.assert_allclose(md.temperature, [0.5, 0, 0, 0])
    np.testing.assert_array_equal(md.top_k, [0, 0, 0, 0])
    np.testing.assert_allclose(md.repetition_penalty, [1.2, 1, 1, 1])
    assert md.bias_ids[0, :2].tolist() == [1, -1]  # 99 is outside the vocab: dropped
    assert md.bias_values[0, 0] == 2.0
    assert (md.prompt_token_ids[2:] == -1).all() and (md.output_token_ids[1:] == -1).all()
    assert md.seeds.dtype == np.uint32 and md.steps.tolist() == [20, 0, 0, 0]


def test_builder_min_tokens_forbids_stop_tokens_until_reached():
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    v = V
    logits = np.zeros((R, v), np.float32)
    logits[:, 5], logits[:, 7] = 10.0, 9.0  # 5 (stop) and 7 (eos) are the two favourites
    md, mode, _ = _build([p, p], outputs=[[1], [1, 2]], rows=R, vocab=v, eos_token_ids=[7])
    assert mode == "random"
    got = sample_jit(logits, md, mode=mode, num_logprobs=None).sampled
    assert int(got[0]) not in (5, 7) and int(got[1]) == 5
    ignore = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    md, mode, _ = _build([ignore], outputs=[[1]], rows=R, vocab=v, eos_token_ids=[7])
    assert mode == "greedy"
    assert int(sample_jit(logits, md, mode=mode, num_logprobs=None).sampled[0]) == 5


def test_builder_end_to_end_and_no_recompile():
    ps = [SamplingParams(temperature=0.8, seed=1, logprobs=2), SamplingParams(temperature=0.0),
          SamplingParams(top_k=3, top_p=0.8)]
    logits = rand_logits(R, V, seed=11)
    sizes = []
    for step in range(4):
        outputs = [[1] * step] * 3
        md, mode, nl = _build(ps, outputs=outputs, rows=R, vocab=V)
        assert (mode, nl) == ("random", 5)
        out = sample_jit(logits, md, mode=mode, num_logprobs=nl)
        assert out.logprobs.shape == (R, 6)
        assert int(out.sampled[1]) == int(logits[1].argmax())
        assert int(out.sampled[2]) in np.argsort(-logits[2])[:3]
        sizes.append(sample_jit._cache_size())
    assert sizes[1:] == sizes[:1] * 3  # new contents, same compiled variant
