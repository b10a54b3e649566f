"""The C++ linear kernel (ops/cpu/linear.cc) against `linear_ref`, its jnp oracle: y = x . w[layer].

Row counts on both sides of the GEMV / packed-GEMM switch (4 rows), past a row block, and past the
switch from a split of the columns to one of the rows over the threads (512 rows a thread), column
counts that are not multiples of a pass (64 / 32 columns), reductions longer than a packed panel,
negative and out-of-range layer indices (jnp's wrap-then-clamp), float32 and 8-bit weights row-major
and in the kernel's strips, and x rounded to bfloat16 (`bf16`, --quantization w8a16) with the CPU's
bfloat16 dot products (AMX tiles or AVX512-BF16) and on the float32 path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenmill.ops.cpu import build
from tokenmill.ops.cpu import linear as cpu_linear
from tokenmill.ops.linear import gate, kernel_layout, linear, linear_ref
from tokenmill.ops.quantization import quantize_windows

F32_REL = 1e-5


def require_kernel() -> None:
    assert cpu_linear.available(), f"the CPU linear kernel did not build: {build.build_error(build.LINEAR)}"


def stack(seed: int, L: int, K: int, N: int, dtype, wsz: int | None):
    w = jnp.asarray(np.random.default_rng(seed).standard_normal((L, K, N)) / np.sqrt(K), jnp.float32)
    if dtype == jnp.float32:
        return w, None
    return jax.jit(quantize_windows, static_argnums=(1, 2, 3))(w, dtype, wsz, 1)


def both(monkeypatch, x, w, layer, scale, wsz, bf16=False):
    monkeypatch.setenv("TOKENMILL_LINEAR_BACKEND", "cpu_kernel")
    kernel = np.asarray(jax.jit(lambda x, w, s: linear(x, w, layer, s, wsz, bf16))(x, w, scale))
    ref = np.asarray(jax.jit(lambda x, w, s: linear_ref(x, w, layer, s, wsz, bf16))(x, w, scale))
    return kernel, ref


def cpu_has_bf16_dot() -> bool:
    """What bf16_pack.h needs (AVX512-BF16); amx_bf16.h's tiles come on top where the CPU has them."""
    return {"avx512_bf16", "avx512f", "avx512bw", "avx512vl"} <= build._cpu_flags()


def with_and_without_dot(monkeypatch, x, w, scale, wsz):
    """(TOKENMILL_CPU_BF16_DOT=1, =0) outputs of the bf16 kernel on layer 0."""
    monkeypatch.setenv("TOKENMILL_LINEAR_BACKEND", "cpu_kernel")
    outputs = []
    for dot in ("1", "0"):
        monkeypatch.setenv("TOKENMILL_CPU_BF16_DOT", dot)
        outputs.append(np.asarray(jax.jit(lambda x: linear(x, w, 0, scale, wsz, bf16=True))(x)))
    return outputs


@pytest.mark.parametrize("M", [1, 3, 4, 5, 13, 150, 260, 1100])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_kernel_matches_reference(monkeypatch, M, dtype):
    require_kernel()
    K, N, wsz = 300, 200, 20
    w, scale = stack(M, 3, K, N, dtype, wsz)
    x = jnp.asarray(np.random.default_rng(100 + M).standard_normal((M, K)), jnp.float32)
    kernel, ref = both(monkeypatch, x, w, 1, scale, wsz if scale is not None else None)
    assert np.max(np.abs(kernel - ref)) <= F32_REL * np.max(np.abs(ref))


@pytest.mark.parametrize("dtype,bf16,dot,strips", [(jnp.float32, False, "0", False), (jnp.float32, False, "0", True),
                                                   (jnp.int8, False, "0", False), (jnp.int8, True, "0", False),
                                                   (jnp.int8, True, "1", False)])
def test_a_row_does_not_depend_on_its_batch(monkeypatch, dtype, bf16, dot, strips):
    """The GEMV (up to 4 rows; 8 for float32 strips) and the packed GEMM run the same FMA chain per
    output, and the bf16 dot products the same sequence for every row: a row's result is bit for bit
    the same alone, among 260 rows (260 x 300 inputs are packed by all threads, the columns split over
    them) or among 1100 (the rows split over them): what keeps greedy output batch-invariant."""
    require_kernel()
    monkeypatch.setenv("TOKENMILL_LINEAR_BACKEND", "cpu_kernel")
    monkeypatch.setenv("TOKENMILL_CPU_BF16_DOT", dot)
    w, scale = stack(9, 2, 300, 224 if strips else 200, dtype, 20)
    if strips:
        w = jax.jit(cpu_linear.to_strips)(w)
    wsz = 20 if scale is not None else None
    x = jnp.asarray(np.random.default_rng(10).standard_normal((1100, 300)), jnp.float32)
    call = jax.jit(lambda x: linear(x, w, 1, scale, wsz, bf16))
    full = np.asarray(call(x))
    for rows in (1, 3, 4, 5, 6, 8, 9, 13, 260):
        np.testing.assert_array_equal(np.asarray(call(x[:rows])), full[:rows])



@pytest.mark.parametrize("dtype,bf16,dot", [(jnp.float32, False, "0"), (jnp.int8, False, "0"), (jnp.int8, True, "1")])
def test_padding_rows_are_skipped_and_zeroed(monkeypatch, dtype, bf16, dot):
    """`rows` (a step's real tokens; the rest pad it to its shape bucket): the rows before it are bit
    for bit what the whole batch gives, those after are zeros, whatever x holds there (NaN here), on
    every path: GEMV, GEMM with the columns split, with the rows split; strips and row-major."""
    require_kernel()
    monkeypatch.setenv("TOKENMILL_LINEAR_BACKEND", "cpu_kernel")
    monkeypatch.setenv("TOKENMILL_CPU_BF16_DOT", dot)
    w, scale = stack(11, 2, 320, 224, dtype, 64)
    wsz = 64 if scale is not None else None
    x = jnp.asarray(np.random.default_rng(12).standard_normal((1100, 320)), jnp.float32)
    for weights in (w, jax.jit(cpu_linear.to_strips)(w)):
        call = jax.jit(lambda x, rows: linear(x, weights, 1, scale, wsz, bf16, rows=rows))
        full = np.asarray(call(x, 1100))
        for rows in (0, 1, 4, 5, 13, 260, 1099):
            padded = x.at[rows:].set(jnp.nan)
            out = np.asarray(call(padded, rows))
            np.testing.assert_array_equal(out[:rows], full[:rows])
            assert not out[rows:].any()


@pytest.mark.parametrize("M", [1, 5, 64, 1100])
@pytest.mark.parametrize("N", [384, 96])  # halves of whole strips (activated in cache for a prefill), of half ones
@pytest.mark.parametrize("dtype,bf16,layout", [(jnp.float32, False, "strips"), (jnp.float32, False, "rows"),
                                               (jnp.int8, False, "strips"), (jnp.int8, True, "strips"),
                                               (jnp.int8, False, "quads")])
def test_gated_product_is_silu_of_gate_times_up(monkeypatch, M, N, dtype, bf16, layout):
    """`gated="silu"` (a gated MLP's fused gate/up projection [K, 2I]): y [M, I] = silu(x . gate) * (x . up),
    on every path: activated in cache where the float32 GEMM splits a prefill's rows and tile by tile
    on the integer path (quads, whole strips), after the whole product elsewhere (decoding, bfloat16
    inputs, halves of part strips); the rows after `rows` zeros."""
    require_kernel()
    monkeypatch.setenv("TOKENMILL_LINEAR_BACKEND", "cpu_kernel")
    K = 320
    w, scale = stack(21, 2, K, N, dtype, 64)
    wsz = 64 if scale is not None else None
    stored = {"strips": cpu_linear.to_strips, "rows": lambda w: w, "quads": cpu_linear.to_int8_quads}[layout](w)
    int16 = layout == "quads"
    x = jnp.asarray(np.random.default_rng(22).standard_normal((M, K)), jnp.float32)
    gated = jax.jit(lambda x, rows: linear(x, stored, 1, scale, wsz, bf16, int16=int16, rows=rows, gated="silu"))
    product = np.asarray(jax.jit(lambda x: linear(x, stored, 1, scale, wsz, bf16, int16=int16))(x))
    out = np.asarray(gated(x, M))
    assert out.shape == (M, N // 2)
    want = np.asarray(jax.nn.silu(product[:, : N // 2]) * product[:, N // 2:])
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=1e-6)
    ref = np.asarray(gate(linear_ref(x, w, 1, scale, wsz, bf16, int16=int16), "silu"))
    np.testing.assert_allclose(out, ref, rtol=1e-4 if dtype == jnp.float32 else 2e-2, atol=1e-4)
    rows = M * 2 // 3
    padded = np.asarray(gated(x.at[rows:].set(jnp.nan), rows))
    np.testing.assert_array_equal(padded[:rows], out[:rows])
    assert not padded[rows:].any()


@pytest.mark.parametrize("M", [1, 3, 4, 5, 8, 13, 150, 1100])
@pytest.mark.parametrize("N", [224, 1120])  # 7 strips (one thread), 35 (weights enough for every thread)
@pytest.mark.parametrize("dtype,bf16,dot", [(jnp.float32, False, "0"), (jnp.int8, False, "0"),
                                            (jnp.float8_e4m3fn, False, "0"), (jnp.int8, True, "1")])
def test_strips_multiply_like_the_row_major_stack(monkeypatch, M, N, dtype, bf16, dot):
    """Weights in the kernel's strips (float32 read in place by the GEMM; 8-bit decoded from them by
    the GEMM's packing and by the bf16 dot products'; streamed by the GEMV, two strips at a time for 8-bit) give bit
    for bit what the same weights give row-major: the same arithmetic per output. The jnp reference
    reads strips too."""
    require_kernel()
    monkeypatch.setenv("TOKENMILL_CPU_BF16_DOT", dot)
    K, wsz = 320, 64 if dtype != jnp.float32 else None
    w, scale = stack(M + N, 3, K, N, dtype, wsz)
    strips = jax.jit(cpu_linear.to_strips)(w)
    assert strips.shape == (3, N // cpu_linear.STRIP, K, cpu_linear.STRIP)
    x = jnp.asarray(np.random.default_rng(300 + M).standard_normal((M, K)), jnp.float32)
    kernel, ref = both(monkeypatch, x, strips, 2, scale, wsz, bf16)
    row_major, row_major_ref = both(monkeypatch, x, w, 2, scale, wsz, bf16)
    np.testing.assert_array_equal(kernel, row_major)
    np.testing.assert_array_equal(ref, row_major_ref)
    assert np.max(np.abs(kernel - ref)) <= F32_REL * np.max(np.abs(ref))


def uint4_stack(seed: int, L: int, K: int, N: int, wsz: int):
    """Random 4-bit codes in the kernel's strips, with a scale and an offset per window (Q4_1-like),
    and the codes themselves [L, K, N]."""
    rng = np.random.default_rng(seed)
    codes = jnp.asarray(rng.integers(0, 16, (L, K, N)), jnp.uint8)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, (L, K // wsz, N)) / (8 * np.sqrt(K)), jnp.float32)
    offset = jnp.asarray(-8 * scale * rng.uniform(0.7, 1.3, scale.shape), jnp.float32)
    return jax.jit(cpu_linear.to_uint4_strips)(codes), scale, offset, codes


@pytest.mark.parametrize("M", [1, 3, 4, 5, 13, 150])
@pytest.mark.parametrize("N", [224, 1120])
def test_4bit_strips_match_reference(monkeypatch, M, N):
    """4-bit codes (GGUF's Q4_0 / Q4_1 blocks as --quantization gguf keeps them), two per byte in
    strips, decoded to code * scale + offset by the GEMV (up to 4 rows) and by the GEMM's packing."""
    require_kernel()
    K, wsz = 320, 32
    packed, scale, offset, codes = uint4_stack(M + N, 3, K, N, wsz)
    assert packed.shape == (3, N // 32, K, 16) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(cpu_linear.from_uint4_strips(packed)), np.asarray(codes))
    x = jnp.asarray(np.random.default_rng(400 + M).standard_normal((M, K)), jnp.float32)
    monkeypatch.setenv("TOKENMILL_LINEAR_BACKEND", "cpu_kernel")
    kernel = np.asarray(jax.jit(lambda x: linear(x, packed, 2, scale, wsz, offset=offset))(x))
    ref = np.asarray(jax.jit(lambda x: linear_ref(x, packed, 2, scale, wsz, offset=offset))(x))
    values = (np.asarray(codes[2], np.float64).reshape(K // wsz, wsz, N) * np.asarray(scale[2])[:, None]
              + np.asarray(offset[2])[:, None]).reshape(K, N)
    np.testing.assert_allclose(ref, np.asarray(x, np.float64) @ values, rtol=1e-4, atol=1e-5)
    assert np.max(np.abs(kernel - ref)) <= F32_REL * np.max(np.abs(ref))


def test_4bit_rows_do_not_depend_on_their_batch(monkeypatch):
    require_kernel()
    monkeypatch.setenv("TOKENMILL_LINEAR_BACKEND", "cpu_kernel")
    packed, scale, offset, _ = uint4_stack(21, 2, 320, 1120, 32)
    x = jnp.asarray(np.random.default_rng(22).standard_normal((150, 320)), jnp.float32)
    call = jax.jit(lambda x: linear(x, packed, 1, scale, 32, offset=offset))
    full = np.asarray(call(x))
    for rows in (1, 3, 4, 5, 13):
        np.testing.assert_array_equal(np.asarray(call(x[:rows])), full[:rows])


def test_strips_are_made_only_where_the_kernel_multiplies_them(monkeypatch):
    require_kernel()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    w = jnp.zeros((2, 8, 64), jnp.float32)
    assert kernel_layout(w, mesh).shape == (2, 2, 8, 32)
    assert kernel_layout(w[:, :, :48], mesh).shape == (2, 8, 48)  # not whole strips
    assert kernel_layout(w.astype(jnp.int8), mesh).shape == (2, 2, 8, 32)
    assert kernel_layout(w.astype(jnp.bfloat16), mesh).dtype == jnp.bfloat16
    monkeypatch.setenv("TOKENMILL_LINEAR_BACKEND", "jnp")
    assert kernel_layout(w, mesh).shape == (2, 8, 64)
    with pytest.raises(ValueError, match="N=48 is not a multiple of 32"):
        cpu_linear.to_strips(w[:, :, :48])


def test_the_model_frees_each_stack_it_converts():
    """Loading converts one stack at a time and frees the placed copy at once: memory peaks at one
    stack above the model, not at twice the model. Stacks left as they are stay usable."""
    require_kernel()
    from tokenmill.model import llama

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    zeros = lambda *shape: jnp.zeros(shape, jnp.float32)  # noqa: E731
    layers = {"wq": zeros(2, 8, 64), "wk": zeros(2, 8, 48), "attn_norm": zeros(2, 8),
              "w1": zeros(2, 4, 2, 64, 96), "w2": zeros(2, 4, 96, 64)}
    head = jnp.zeros((1, 8, 64), jnp.int8)
    params = {"embed": zeros(16, 8), "layers": layers, "lm_head_q": head, "lm_head_q_scale": zeros(1, 1, 64)}
    converted = llama.to_kernel_layout(params, mesh)
    out = converted["layers"]
    assert converted["lm_head_q"].shape == (1, 2, 8, 32) and head.is_deleted()
    assert out["wq"].shape == (2, 2, 8, 32) and layers["wq"].is_deleted()
    assert out["w1"].shape == (2, 4, 2, 3, 64, 32) and layers["w1"].is_deleted() and layers["w2"].is_deleted()
    assert out["wk"] is layers["wk"] and not layers["wk"].is_deleted()  # 48 columns: not whole strips
    assert out["attn_norm"] is layers["attn_norm"]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("vocab", [64, 48])
def test_a_float_lm_head_is_multiplied_from_strips(tied, vocab):
    """Where the kernel runs, a float32 LM head is stored in strips as a stack of one (replacing the
    embedding it is tied to, whose rows the lookup then reads from the strips) and multiplied there,
    giving XLA's logits and the same embeddings; a vocabulary of no whole strips keeps XLA's dot."""
    require_kernel()
    from tokenmill.config import ModelConfig
    from tokenmill.model import llama

    cfg = ModelConfig("LlamaForCausalLM", vocab_size=vocab, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    rng = np.random.default_rng(7)
    embed = jnp.asarray(rng.standard_normal((vocab, 16)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((16, vocab)), jnp.float32)
    params = {"embed": embed, "layers": {}} | ({} if tied else {"lm_head": head})
    hidden = jnp.asarray(rng.standard_normal((5, 16)), jnp.float32)
    ids = jnp.asarray([0, vocab - 1, 33 % vocab, 5, 31], jnp.int32)
    expected_logits = np.asarray(llama.compute_logits(params, cfg, hidden))
    expected_rows = np.asarray(embed[ids])
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    converted = llama.to_kernel_layout(params, mesh)
    if vocab % cpu_linear.STRIP:
        assert "lm_head_strips" not in converted and converted["embed"] is embed
        assert tied or converted["lm_head"] is head
    else:
        assert converted["lm_head_strips"].shape == (1, vocab // 32, 16, 32) and "lm_head" not in converted
        assert ("embed" not in converted and embed.is_deleted()) if tied else (converted["embed"] is embed
                                                                              and head.is_deleted())
    logits = np.asarray(jax.jit(lambda p, h: llama.compute_logits(p, cfg, h))(converted, hidden))
    np.testing.assert_allclose(logits, expected_logits, rtol=F32_REL, atol=F32_REL)
    np.testing.assert_array_equal(np.asarray(jax.jit(llama.embed_tokens)(converted, ids)), expected_rows)


@pytest.mark.parametrize("quantized", [False, True])
def test_fused_projections_give_what_each_gives_alone(quantized):
    """Where the kernel runs them, q/k/v and gate/up are stored side by side and multiplied in one
    call (llama.FUSED): the split outputs are bit for bit those of the separate stacks."""
    require_kernel()
    from tokenmill.config import ModelConfig
    from tokenmill.model import llama

    cfg = ModelConfig("LlamaForCausalLM", vocab_size=16, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=64,
                      quantization="int8" if quantized else None, quant_window=32 if quantized else 0)
    widths = {"wq": 64, "wk": 32, "wv": 32, "w_gate": 96, "w_up": 96}
    layers = {}
    for i, (name, n) in enumerate(widths.items()):
        w, scale = stack(i, 2, 64, n, jnp.int8 if quantized else jnp.float32, 32)
        layers[name] = w
        if quantized:
            layers[name + "_scale"] = scale
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    fused = llama.to_kernel_layout({"layers": dict(layers)}, mesh)["layers"]
    assert set(fused) == {"w_qkv", "w_gate_up"} | ({"w_qkv_scale", "w_gate_up_scale"} if quantized else set())
    assert fused["w_qkv"].shape == (2, 128 // 32, 64, 32) and fused["w_gate_up"].shape == (2, 192 // 32, 64, 32)
    assert all(w.is_deleted() for w in layers.values())
    # the separate stacks again, made the same way
    for i, (name, n) in enumerate(widths.items()):
        layers[name], scale = stack(i, 2, 64, n, jnp.int8 if quantized else jnp.float32, 32)
        if quantized:
            layers[name + "_scale"] = scale
    x = jnp.asarray(np.random.default_rng(5).standard_normal((3, 64)), jnp.float32)
    for members in llama.FUSED.values():
        together = llama.projections(cfg, fused, 1)(x, *members)
        alone = llama.projections(cfg, layers, 1)(x, *members)
        assert [a.shape for a in together] == [(3, widths[m]) for m in members]
        for a, b in zip(together, alone):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("layer", [-1, 7, -9])
def test_layer_index_wraps_then_clamps_like_jnp(monkeypatch, layer):
    require_kernel()
    w, scale = stack(5, 3, 64, 128, jnp.int8, 64)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 64)), jnp.float32)
    kernel, ref = both(monkeypatch, x, w, layer, scale, 64)
    np.testing.assert_allclose(kernel, ref, rtol=1e-5, atol=1e-5)


def test_int8_is_close_to_float32():
    """Per-window int8 keeps ~7 bits of each window's absmax: the product moves by about a percent."""
    w, _ = stack(7, 1, 256, 96, jnp.float32, None)
    q, scale = stack(7, 1, 256, 96, jnp.int8, 64)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((4, 256)), jnp.float32)
    exact, approx = np.asarray(linear_ref(x, w, 0)), np.asarray(linear_ref(x, q, 0, scale, 64))
    assert np.linalg.norm(approx - exact) <= 0.02 * np.linalg.norm(exact)


@pytest.mark.parametrize("dot", ["1", "0"])
@pytest.mark.parametrize("M,K,N,wsz", [(1, 300, 200, 20), (5, 64, 16, 16), (7, 96, 48, 32), (33, 300, 40, 300),
                                       (17, 300, 37, 60), (150, 576, 200, 64),
                                       (40, 576, 1100, 64)])  # the last: weights enough for every thread
def test_bf16_products_match_reference(monkeypatch, dot, M, K, N, wsz):
    """x rounded to bfloat16 times the 8-bit weights: with the bf16 dot products where the CPU has them (windows of
    32 or 64 rows, or one window over K padded to 32; partial row and column tiles), else on the
    float32 path (windows of 16, 20, 60)."""
    require_kernel()
    monkeypatch.setenv("TOKENMILL_CPU_BF16_DOT", dot)
    w, scale = stack(M + K, 3, K, N, jnp.int8, wsz)
    x = jnp.asarray(np.random.default_rng(200 + M).standard_normal((M, K)), jnp.float32)
    kernel, ref = both(monkeypatch, x, w, 2, scale, wsz, bf16=True)
    assert np.max(np.abs(kernel - ref)) <= F32_REL * np.max(np.abs(ref))
    # and x was rounded: float32 products land elsewhere
    assert np.max(np.abs(kernel - both(monkeypatch, x, w, 2, scale, wsz)[1])) > F32_REL * np.max(np.abs(ref))


def test_bf16_dot_products_run_where_the_cpu_has_them(monkeypatch):
    """TOKENMILL_CPU_BF16_DOT=1 multiplies with AMX tiles or AVX512-BF16 on a CPU that has them (their
    sums run in another order than the float32 path's, so some output differs in its last bits), and
    changes nothing elsewhere."""
    require_kernel()
    w, scale = stack(11, 1, 576, 256, jnp.int8, 64)
    x = jnp.asarray(np.random.default_rng(12).standard_normal((64, 576)), jnp.float32)
    dot, fma = with_and_without_dot(monkeypatch, x, w, scale, 64)
    assert ("-mavx512bf16" in build.isa_flags()) == cpu_has_bf16_dot()
    assert (not np.array_equal(dot, fma)) == cpu_has_bf16_dot()


def test_windows_the_dot_products_cannot_follow_take_the_float32_path(monkeypatch):
    require_kernel()
    w, scale = stack(13, 1, 300, 64, jnp.int8, 20)
    x = jnp.asarray(np.random.default_rng(14).standard_normal((40, 300)), jnp.float32)
    np.testing.assert_array_equal(*with_and_without_dot(monkeypatch, x, w, scale, 20))


def test_bf16_products_need_8bit_weights():
    with pytest.raises(ValueError, match="bf16=True multiplies 8-bit weights"):
        linear(jnp.zeros((1, 8), jnp.float32), jnp.zeros((1, 8, 8), jnp.float32), 0, bf16=True)


def test_forcing_the_kernel_on_unsupported_weights_is_refused(monkeypatch):
    monkeypatch.setenv("TOKENMILL_LINEAR_BACKEND", "cpu_kernel")
    w = jnp.zeros((1, 8, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="TOKENMILL_LINEAR_BACKEND=cpu_kernel"):
        linear(jnp.zeros((1, 8), jnp.float32), w, 0)
