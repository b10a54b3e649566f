"""fused_moe against ref_moe (the oracle), ref_moe against a per-token numpy computation.

Float32 results must agree to `F32_REL` of the output's largest magnitude: the two paths sum the
same products in different orders, nothing more.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenmill.ops.moe import _decode_float8, fused_moe, ref_moe, route, tile_layout
from tokenmill.ops.quantization import quantize_windows

F32_REL = 1e-5
WSZ = 8  # the sub-channel quantization window of these tests

# Quantized experts against the float experts they came from: the error that rounding each weight
# to the format leaves in the output, relative to its norm (3 mantissa bits for e4m3, 2 for e5m2,
# 1 for e2m1; int8 keeps ~7 bits of each window's absmax).
QUANT_REL = {jnp.int8: 0.02, jnp.float8_e4m3fn: 0.06, jnp.float8_e5m2: 0.12, jnp.float4_e2m1fn: 0.3}


def make_moe(seed: int, T: int, E: int, D: int = 16, F: int = 24, biases: bool = False):
    """Inputs whose gate/up values reach past swigluoai's clamp (|x| > 7) now and then."""
    rng = np.random.default_rng(seed)
    arrays = dict(
        tokens=rng.standard_normal((T, D)),
        w1=rng.standard_normal((E, 2, D, F)) * 3 / np.sqrt(D),
        w2=rng.standard_normal((E, F, D)) / np.sqrt(F),
        gating_output=rng.standard_normal((T, E)) * 2,
    )
    if biases:
        arrays.update(b1=rng.standard_normal((E, 2, F)), b2=rng.standard_normal((E, D)))
    return {k: jnp.asarray(v, jnp.float32) for k, v in arrays.items()}


def run(fn, arrays: dict, top_k: int, **options):
    """fn under jit: the arrays are traced, top_k and the keyword options static."""
    return np.asarray(jax.jit(lambda a: fn(top_k=top_k, **a, **options))(arrays))


def assert_close(actual, expected, rel):
    err, scale = np.max(np.abs(actual - expected)), np.max(np.abs(expected))
    assert err <= rel * scale, f"max error {err:.3g}, output scale {scale:.3g}"


def both(arrays, top_k, **options):
    """(fused_moe, ref_moe) on the same inputs, compiled together."""
    call = jax.jit(lambda a: (fused_moe(**a, top_k=top_k, **options), ref_moe(**a, top_k=top_k, **options)))
    return tuple(np.asarray(out) for out in call(arrays))


def numpy_moe(a: dict, top_k: int, renormalize: bool, act_fn: str, alpha=1.702, limit=7.0):
    """Token by token, expert by expert, in float64."""
    a = {k: np.asarray(v, np.float64) for k, v in a.items()}
    acts = {
        "silu": lambda g, u: g / (1 + np.exp(-g)) * u,
        "swigluoai": lambda g, u: np.minimum(g, limit) / (1 + np.exp(-alpha * np.minimum(g, limit)))
        * (np.clip(u, -limit, limit) + 1),
    }
    out = np.zeros_like(a["tokens"])
    for t, x in enumerate(a["tokens"]):
        p = np.exp(a["gating_output"][t] - a["gating_output"][t].max())
        p /= p.sum()
        chosen = np.argsort(-p, kind="stable")[:top_k]
        weights = p[chosen] / p[chosen].sum() if renormalize else p[chosen]
        for e, w in zip(chosen, weights):
            gate, up = x @ a["w1"][e, 0], x @ a["w1"][e, 1]
            if "b1" in a:
                gate, up = gate + a["b1"][e, 0], up + a["b1"][e, 1]
            y = acts[act_fn](gate, up) @ a["w2"][e]
            if "b2" in a:
                y = y + a["b2"][e]
            out[t] += w * y
    return out


@pytest.mark.parametrize("act_fn,renormalize,biases", [("silu", True, False), ("swigluoai", False, True)])
def test_reference_matches_numpy(act_fn, renormalize, biases):
    a = make_moe(0, T=5, E=6, biases=biases)
    ref = run(ref_moe, a, 3, renormalize_topk_logits=renormalize, act_fn=act_fn)
    assert_close(ref, numpy_moe(a, 3, renormalize, act_fn), 1e-5)


def test_routing():
    gating = jnp.asarray(np.random.default_rng(1).standard_normal((4, 10)), jnp.float32)
    weights, ids = route(gating, 3, renormalize=False)
    probs = np.asarray(jax.nn.softmax(gating, axis=-1))
    np.testing.assert_array_equal(np.asarray(ids), np.argsort(-probs, axis=-1)[:, :3])
    np.testing.assert_allclose(np.asarray(weights), np.take_along_axis(probs, np.asarray(ids), -1), rtol=1e-6)
    renormalized, _ = route(gating, 3, renormalize=True)
    np.testing.assert_allclose(np.asarray(renormalized).sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize(
    "act_fn,renormalize,biases",
    [
        ("silu", True, False),
        ("gelu", False, True),
        ("gelu_pytorch_tanh", True, True),
        ("swigluoai", False, True),
        ("swigluoai", True, False),
    ],
)
def test_activations_biases_renormalisation(act_fn, renormalize, biases):
    a = make_moe(2, T=13, E=16, biases=biases)
    fused, ref = both(a, 2, renormalize_topk_logits=renormalize, act_fn=act_fn)
    assert_close(fused, ref, F32_REL)


@pytest.mark.parametrize("T,top_k,E", [(1, 1, 16), (7, 2, 32), (37, 8, 128)])
def test_token_counts_top_k_and_experts(T, top_k, E):
    a = make_moe(3, T=T, E=E)
    fused, ref = both(a, top_k, renormalize_topk_logits=True, act_fn="silu")
    assert_close(fused, ref, F32_REL)


def test_idle_experts_cost_no_tiles():
    """All 300 tokens routed to experts 3 and 40 of 64: groups over the largest tile (256 rows), so
    two tiles each, and no tile at all for the 62 idle experts."""
    a = make_moe(4, T=300, E=64)
    hot = np.full((300, 64), -30.0, np.float32)
    hot[:, 3], hot[:, 40] = 2.0, np.linspace(1, 3, 300)
    a["gating_output"] = jnp.asarray(hot)
    weights, ids = route(a["gating_output"], 2, renormalize=True)
    layout = jax.jit(tile_layout, static_argnums=(2, 3))(weights, ids, 64, 0)
    assert int(layout.size_count.sum()) == 4
    assert sorted(np.asarray(layout.tile_expert)[:4].tolist()) == [3, 3, 40, 40]
    fused, ref = both(a, 2, renormalize_topk_logits=True, act_fn="silu")
    assert_close(fused, ref, F32_REL)


def quantized(a: dict, dtype) -> dict:
    """a with w1 and w2 quantized to `dtype` and their scales beside them."""
    quantize = jax.jit(quantize_windows, static_argnums=(1, 2, 3))
    q = dict(a)
    q["w1"], q["w1_scale"] = quantize(a["w1"], dtype, WSZ, 2)
    q["w2"], q["w2_scale"] = quantize(a["w2"], dtype, WSZ, 1)
    return q


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn])
def test_subchannel_quantized_experts(dtype):
    a = make_moe(5, T=13, E=16, biases=True)
    q = quantized(a, dtype)
    assert q["w1"].dtype == dtype and q["w1_scale"].shape == (16, 2, 16 // WSZ, 24)
    assert q["w2_scale"].shape == (16, 24 // WSZ, 16)
    options = dict(renormalize_topk_logits=True, act_fn="silu", subc_quant_wsz=WSZ)
    fused, ref = both(q, 4, **options)
    assert_close(fused, ref, F32_REL)  # the same quantized weights: only summation order differs
    exact = run(ref_moe, a, 4, renormalize_topk_logits=True, act_fn="silu")
    rel = np.linalg.norm(fused - exact) / np.linalg.norm(exact)
    assert rel < QUANT_REL[dtype], f"{jnp.dtype(dtype).name}: relative error {rel:.3g}"


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_float8_decoding_matches_a_cast_on_every_code(dtype):
    """fused_moe decodes float8 expert weights from their bits: subnormals, ±0, inf and NaN included."""
    codes = np.arange(256, dtype=np.uint8)
    decoded = np.asarray(jax.jit(_decode_float8, static_argnums=1)(jnp.asarray(codes), dtype))
    cast = codes.view(jnp.dtype(dtype)).astype(np.float32)
    np.testing.assert_array_equal(decoded, cast)
    np.testing.assert_array_equal(np.signbit(decoded[~np.isnan(decoded)]), np.signbit(cast[~np.isnan(cast)]))


def test_expert_parallel_on_1_2_4_8_devices():
    """Each mesh in a fresh process: the host device count is fixed before JAX starts."""
    script = Path(__file__).with_name("moe_expert_parallel.py")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "expert parallel OK" in proc.stdout, proc.stdout


def test_experts_must_divide_over_the_model_axis():
    a = make_moe(6, T=3, E=12)
    mesh = jax.sharding.AbstractMesh((1, 8), ("data", "model"))
    with pytest.raises(ValueError, match=r"experts \(12\).*model axis size \(8\)"):
        fused_moe(**a, top_k=2, renormalize_topk_logits=True, act_fn="silu", mesh=mesh)


def _bad(**changes):
    a = make_moe(7, T=3, E=4, D=16, F=24)
    call = dict(a, top_k=2, renormalize_topk_logits=True, act_fn="silu")
    call.update(changes)
    return call


@pytest.mark.parametrize(
    "call,match",
    [
        (_bad(act_fn="relu6"), "act_fn"),
        (_bad(top_k=5), "top_k"),
        (_bad(top_k=0), "top_k"),
        (_bad(tokens=jnp.zeros((3, 8))), "w1"),
        (_bad(w2=jnp.zeros((4, 16, 16))), "w2"),
        (_bad(gating_output=jnp.zeros((3, 5))), "gating_output"),
        (_bad(b1=jnp.zeros((4, 24))), "b1"),
        (_bad(b2=jnp.zeros((4, 24))), "b2"),
        (_bad(w1_scale=jnp.ones((4, 2, 2, 24)), w2_scale=jnp.ones((4, 3, 16))), "subc_quant_wsz"),
        (_bad(w1_scale=jnp.ones((4, 2, 2, 24))), "w2_scale"),
        (_bad(subc_quant_wsz=8), "subc_quant_wsz"),
        (_bad(w1_scale=jnp.ones((4, 2, 1, 24)), w2_scale=jnp.ones((4, 1, 16)), subc_quant_wsz=16), "subc_quant"),
        (_bad(w1_scale=jnp.ones((4, 2, 3, 24)), w2_scale=jnp.ones((4, 3, 16)), subc_quant_wsz=8), "w1_scale"),
        (_bad(w1=jnp.zeros((4, 2, 16, 24), jnp.int8)), "w1_scale"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        fused_moe(**call)


def test_quantize_needs_wsz_to_divide_the_reduction_axis():
    with pytest.raises(ValueError, match="wsz"):
        quantize_windows(jnp.zeros((2, 24, 16)), jnp.int8, 16, reduction_axis=1)
