"""The C++ expert-FFN kernel (ops/cpu/moe_experts.cc) against the jnp tiles of ops/moe.py, its oracle.

Shapes are chosen to reach every edge of the kernel's blocking: expert groups larger than a work
item (128 rows), row counts that are not multiples of the register block, hidden and intermediate
sizes that are not multiples of a column strip (16 or 32) and reductions longer than one packed
panel (256), idle experts, one token; int8 / float8 experts, which it dequantizes as it packs; and
float32 experts in the kernel's strips, which it reads in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_moe import F32_REL, WSZ, assert_close, make_moe, quantized
from tokenmill.ops.cpu import build
from tokenmill.ops.cpu import moe as cpu_moe
from tokenmill.ops.moe import fused_moe, kernel_layout, ref_moe


def require_kernel() -> None:
    assert cpu_moe.available(), f"the CPU MoE kernel did not build: {build.build_error(build.MOE_EXPERTS)}"


def fused_with(monkeypatch, backend: str, arrays: dict, top_k: int, **options) -> np.ndarray:
    monkeypatch.setenv("TOKENMILL_MOE_BACKEND", backend)
    return np.asarray(jax.jit(lambda a: fused_moe(**a, top_k=top_k, **options))(arrays))


CASES = [
    # T, E, D, F, top_k, act_fn, biases
    (300, 4, 40, 72, 2, "silu", True),  # groups of ~150 rows: two work items per expert
    (9, 64, 64, 96, 8, "gelu", False),  # most experts idle or with one row
    (1, 8, 48, 16, 1, "gelu_pytorch_tanh", True),  # one token, one expert
    (23, 6, 300, 264, 3, "swigluoai", True),  # reductions over 256 and N over one 256-column panel
]


@pytest.mark.parametrize("T,E,D,F,top_k,act_fn,biases", CASES)
def test_kernel_matches_jnp_tiles(monkeypatch, T, E, D, F, top_k, act_fn, biases):
    require_kernel()
    a = make_moe(30 + T, T=T, E=E, D=D, F=F, biases=biases)
    options = dict(renormalize_topk_logits=T % 2 == 0, act_fn=act_fn)
    kernel = fused_with(monkeypatch, "cpu_kernel", a, top_k, **options)
    tiles = fused_with(monkeypatch, "jnp", a, top_k, **options)
    assert_close(kernel, tiles, F32_REL)
    assert_close(kernel, np.asarray(jax.jit(lambda a: ref_moe(**a, top_k=top_k, **options))(a)), F32_REL)


@pytest.mark.parametrize("dtype,strips", [(jnp.float32, False), (jnp.float32, True), (jnp.int8, False)])
def test_a_token_does_not_depend_on_its_batch(monkeypatch, dtype, strips):
    """Each assignment's expert output has its own row and the rows are added in sorted order (a
    token's experts ascending), whichever thread computed them; each row's matmuls run the same FMA
    chain at any group size. So a token's output is bit for bit the same alone, among 300 tokens
    (groups of ~75 rows, several work items and threads), and on every call."""
    require_kernel()
    a = make_moe(70, T=300, E=8, D=288, F=320, biases=True)
    options = dict(renormalize_topk_logits=True, act_fn="silu")
    if dtype != jnp.float32:
        a = quantized(a, dtype)
        options["subc_quant_wsz"] = WSZ
    if strips:
        a["w1"], a["w2"] = kernel_layout(a["w1"], a["w2"], one_device_mesh())
    full = fused_with(monkeypatch, "cpu_kernel", a, 2, **options)
    np.testing.assert_array_equal(fused_with(monkeypatch, "cpu_kernel", a, 2, **options), full)
    for rows in (1, 3, 17):
        alone = {**a, "tokens": a["tokens"][:rows], "gating_output": a["gating_output"][:rows]}
        np.testing.assert_array_equal(fused_with(monkeypatch, "cpu_kernel", alone, 2, **options), full[:rows])


def one_device_mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))


@pytest.mark.parametrize("T,E,D,F,top_k,act_fn,biases", [
    (300, 4, 64, 96, 2, "silu", True),  # two work items per expert
    (9, 64, 64, 96, 8, "gelu", False),  # groups of one to a few rows: the GEMV on strips
    (23, 6, 288, 320, 3, "swigluoai", True),  # reductions over 256, N over one 256-column panel
])
def test_experts_in_strips_match_row_major(monkeypatch, T, E, D, F, top_k, act_fn, biases):
    """Float32 experts in the kernel's strips (kernel_layout: what a model on one CPU device stores):
    the kernel multiplies them in place, the jnp tiles and the expert-parallel path read them back;
    all agree with the row-major experts."""
    require_kernel()
    a = make_moe(50 + T, T=T, E=E, D=D, F=F, biases=biases)
    strips = dict(a)
    strips["w1"], strips["w2"] = kernel_layout(a["w1"], a["w2"], one_device_mesh())
    assert strips["w1"].shape == (E, 2, F // 32, D, 32) and strips["w2"].shape == (E, D // 32, F, 32)
    options = dict(renormalize_topk_logits=True, act_fn=act_fn)
    row_major = fused_with(monkeypatch, "cpu_kernel", a, top_k, **options)
    assert_close(fused_with(monkeypatch, "cpu_kernel", strips, top_k, **options), row_major, F32_REL)
    assert_close(fused_with(monkeypatch, "jnp", strips, top_k, **options), row_major, F32_REL)
    assert_close(fused_with(monkeypatch, "cpu_kernel", strips, top_k, **options, mesh=one_device_mesh()),
                 row_major, F32_REL)


def test_only_float32_experts_the_kernel_runs_go_to_strips(monkeypatch):
    a = make_moe(60, T=5, E=4, D=64, F=96)
    q = quantized(a, jnp.int8)
    mesh = one_device_mesh()
    assert kernel_layout(q["w1"], q["w2"], mesh)[0].shape == q["w1"].shape
    odd = make_moe(61, T=5, E=4, D=64, F=40)  # F not whole strips
    assert kernel_layout(odd["w1"], odd["w2"], mesh)[0].shape == odd["w1"].shape
    monkeypatch.setenv("TOKENMILL_MOE_BACKEND", "jnp")
    assert kernel_layout(a["w1"], a["w2"], mesh)[0].shape == a["w1"].shape


@pytest.mark.parametrize("isa", [("-mavx2", "-mfma"), ()], ids=["avx2", "portable"])
def test_narrower_builds_match(monkeypatch, isa):
    """The AVX2 build (8-wide registers, 6-row blocks: what CPUs without AVX-512 get) and the portable
    build compile and agree with the jnp tiles too."""
    require_kernel()
    monkeypatch.setattr(build, "isa_flags", lambda: isa)
    name = "_".join(["tokenmill_moe_experts"] + [flag.strip("-m") for flag in isa] + ["portable"] * (not isa))
    kernel = build.Kernel(name, build.MOE_EXPERTS.symbol, build.MOE_EXPERTS.source)
    assert build.load(kernel), build.build_error(kernel)
    monkeypatch.setattr(cpu_moe, "MOE_EXPERTS", kernel)
    a = make_moe(40, T=37, E=8, D=72, F=40, biases=True)
    options = dict(renormalize_topk_logits=True, act_fn="silu")
    kernel, tiles = (fused_with(monkeypatch, backend, a, 2, **options) for backend in ("cpu_kernel", "jnp"))
    assert_close(kernel, tiles, F32_REL)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_8bit_experts_match_jnp_tiles(monkeypatch, dtype):
    """The kernel dequantizes as it packs, the tiles expert by expert: the same values either way."""
    require_kernel()
    q = quantized(make_moe(44, T=29, E=8, D=48, F=40, biases=True), dtype)
    options = dict(renormalize_topk_logits=True, act_fn="swigluoai", subc_quant_wsz=WSZ)
    kernel, tiles = (fused_with(monkeypatch, backend, q, 3, **options) for backend in ("cpu_kernel", "jnp"))
    assert_close(kernel, tiles, F32_REL)


def test_auto_takes_the_kernel_except_for_fp4_experts(monkeypatch):
    require_kernel()
    calls = []
    real = cpu_moe.moe_experts
    monkeypatch.setattr(cpu_moe, "moe_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    options = dict(renormalize_topk_logits=True, act_fn="silu")
    fused_with(monkeypatch, "auto", make_moe(41, T=5, E=8), 2, **options)
    fused_with(monkeypatch, "auto", quantized(make_moe(42, T=5, E=8), jnp.int8), 2, **options, subc_quant_wsz=WSZ)
    assert calls == [1, 1]
    fused_with(monkeypatch, "auto", quantized(make_moe(42, T=5, E=8), jnp.float4_e2m1fn), 2, **options,
               subc_quant_wsz=WSZ)
    assert calls == [1, 1]


def test_forcing_the_kernel_on_fp4_experts_is_refused(monkeypatch):
    q = quantized(make_moe(43, T=5, E=8), jnp.float4_e2m1fn)
    with pytest.raises(ValueError, match="TOKENMILL_MOE_BACKEND=cpu_kernel"):
        fused_with(monkeypatch, "cpu_kernel", q, 2, renormalize_topk_logits=True, act_fn="silu", subc_quant_wsz=WSZ)
