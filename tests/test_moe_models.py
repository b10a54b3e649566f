"""Mixture-of-experts checkpoints (Mixtral, Qwen3-MoE, gpt-oss): config, expert layouts, refusals.

Greedy parity with transformers for these models is in test_model_parity.py (same tiny models).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from tests.tiny_models import make_tiny_checkpoint
from tokenmill.model.loader import ModelLoadError, load_model

MOE_ARCHS = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """arch -> (checkpoint dir, the transformers model it was saved from)."""
    root = tmp_path_factory.mktemp("tiny_moe")
    return {arch: (str(root / arch), make_tiny_checkpoint(arch, str(root / arch))) for arch in MOE_ARCHS}


def _experts(model) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(w1 [L, E, 2, D, F], w2 [L, E, F, D], b1, b2) from transformers' in-memory expert modules."""
    w1, w2, b1, b2 = [], [], [], []
    for layer in model.model.layers:
        ex = layer.mlp.experts
        gu, down = ex.gate_up_proj.detach().numpy(), ex.down_proj.detach().numpy()
        if hasattr(ex, "gate_up_proj_bias"):  # gpt-oss: [E, D, 2F] interleaved, down [E, F, D], biases
            w1.append(np.stack([gu[..., ::2], gu[..., 1::2]], axis=1))
            w2.append(down)
            bias = ex.gate_up_proj_bias.detach().numpy()
            b1.append(np.stack([bias[..., ::2], bias[..., 1::2]], axis=1))
            b2.append(ex.down_proj_bias.detach().numpy())
        else:  # [E, 2F, D] (gate rows, then up rows), down [E, D, F]
            f = gu.shape[1] // 2
            w1.append(np.stack([gu[:, :f].transpose(0, 2, 1), gu[:, f:].transpose(0, 2, 1)], axis=1))
            w2.append(down.transpose(0, 2, 1))
    return np.stack(w1), np.stack(w2), np.stack(b1) if b1 else None, np.stack(b2) if b2 else None


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_checkpoint_loads_experts_router_and_config(tiny_moe, arch):
    path, model = tiny_moe[arch]
    m = load_model(path)
    cfg, hf = m.config, model.config
    assert cfg.is_moe and cfg.architecture == arch
    assert cfg.num_experts == getattr(hf, "num_local_experts", getattr(hf, "num_experts", None))
    assert cfg.num_experts_per_tok == hf.num_experts_per_tok
    layers = m.params["layers"]
    assert "w_gate" not in layers
    w1, w2, b1, b2 = _experts(model)
    np.testing.assert_array_equal(layers["w1"], w1)
    np.testing.assert_array_equal(layers["w2"], w2)
    router = np.stack([(ly.mlp.gate if hasattr(ly.mlp, "gate") else ly.mlp.router).weight.detach().numpy().T
                       for ly in model.model.layers])
    np.testing.assert_array_equal(layers["router"], router)
    if arch == "GptOssForCausalLM":
        assert cfg.moe_act == "swigluoai" and cfg.attention_sinks and cfg.o_proj_bias and cfg.moe_bias
        assert cfg.sliding_layers() == (True, False, True)
        np.testing.assert_array_equal(layers["b1"], b1)
        np.testing.assert_array_equal(layers["b2"], b2)
        sinks = np.stack([ly.self_attn.sinks.detach().numpy() for ly in model.model.layers])
        np.testing.assert_array_equal(layers["sinks"], sinks)
        assert layers["bo"].shape == (3, cfg.hidden_size)
    else:
        assert cfg.moe_act == "silu" and not cfg.attention_sinks and "b1" not in layers
        assert cfg.norm_topk_prob == (arch == "MixtralForCausalLM")  # the tiny Qwen3-MoE does not renormalise


def test_yarn_rope_matches_transformers(tiny_moe):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tokenmill.ops.rotary import inv_frequencies, rope_attention_factor

    path, model = tiny_moe["GptOssForCausalLM"]
    cfg = load_model(path).config
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](model.config, torch.device("cpu"))
    np.testing.assert_allclose(inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict),
                               ref_inv.numpy(), rtol=1e-6)
    assert rope_attention_factor(cfg.rope_scaling_dict) == pytest.approx(ref_factor)
    assert ref_factor != 1.0


def _copy(tiny_moe, arch, tmp_path) -> str:
    dst = str(tmp_path / arch)
    shutil.copytree(tiny_moe[arch][0], dst)
    return dst


def _edit_config(path: str, **changes):
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        d = json.load(f)
    d.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(d, f)


def test_qwen3_moe_with_dense_layers_is_refused(tiny_moe, tmp_path):
    path = _copy(tiny_moe, "Qwen3MoeForCausalLM", tmp_path)
    _edit_config(path, mlp_only_layers=[0])
    with pytest.raises(ModelLoadError, match="dense layers"):
        load_model(path)


def _rewrite_weights(path: str, edit):
    for f in [f for f in os.listdir(path) if f.endswith(".safetensors")]:
        full = os.path.join(path, f)
        save_file(edit(load_file(full)), full, metadata={"format": "pt"})


def test_missing_expert_and_wrong_expert_shape_are_named(tiny_moe, tmp_path):
    path = _copy(tiny_moe, "MixtralForCausalLM", tmp_path)
    name = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    _rewrite_weights(path, lambda sd: {k: v for k, v in sd.items() if k != name})
    with pytest.raises(ModelLoadError, match=f"missing tensor '{name}'"):
        load_model(path)
    path = _copy(tiny_moe, "MixtralForCausalLM", tmp_path / "b")
    _edit_config(path, num_local_experts=9)
    with pytest.raises(ModelLoadError, match=r"gate.weight' has shape \(8, 64\).*num_experts=9"):
        load_model(path)
    path = _copy(tiny_moe, "MixtralForCausalLM", tmp_path / "c")
    _edit_config(path, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"experts.0.w1.weight' has shape \(128, 64\).*needs \(96, 64\)"):
        load_model(path)


def test_mxfp4_experts_get_a_clear_error(tiny_moe, tmp_path):
    """Released gpt-oss checkpoints keep experts in MXFP4 (`*_blocks`, `*_scales`): not loadable yet."""
    path = _copy(tiny_moe, "GptOssForCausalLM", tmp_path)

    def to_mxfp4_names(sd):
        out = {}
        for k, v in sd.items():
            if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
                out[k + "_blocks"] = np.zeros(4, np.uint8)
                out[k + "_scales"] = np.zeros(4, np.uint8)
            else:
                out[k] = v
        return out

    _rewrite_weights(path, to_mxfp4_names)
    with pytest.raises(ModelLoadError, match="MXFP4"):
        load_model(path)


PROMPTS = [[5, 9, 77, 31], [100, 4, 8, 15, 16, 23, 42, 99, 7, 13], [33, 44]]


@pytest.fixture(scope="module")
def mixtral_llm_outputs(tiny_moe):
    """Greedy outputs of the tiny Mixtral through the engine: fp32 experts, int8 and fp8 (window 32)."""
    from tokenmill import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    outs = {}
    for quant in (None, "int8", "fp8_e4m3"):
        llm = LLM(tiny_moe["MixtralForCausalLM"][0], max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                  block_size=4, num_blocks=64, expert_quantization=quant, expert_quantization_window=32)
        outs[quant] = (llm.generate(PROMPTS, params, use_tqdm=False), llm.engine.runner.params["layers"]["w1"])
    return outs


@pytest.mark.parametrize("quant, dtype, tol", [("int8", "int8", 0.005), ("fp8_e4m3", "float8_e4m3fn", 0.01)])
def test_quantized_experts_run_in_8_bits_and_stay_close(mixtral_llm_outputs, quant, dtype, tol):
    ref, _ = mixtral_llm_outputs[None]
    out, w1 = mixtral_llm_outputs[quant]
    assert str(w1.dtype) == dtype  # on the device in 8 bits, dequantized tile by tile in the op
    for r, o in zip(ref, out):
        r, o = r.outputs[0], o.outputs[0]
        assert o.token_ids[0] == r.token_ids[0]
        same = 0
        for tok_r, tok_o, lp_r, lp_o in zip(r.token_ids, o.token_ids, r.logprobs, o.logprobs):
            if tok_r != tok_o:
                break
            same += 1
            assert abs(lp_r[tok_r].logprob - lp_o[tok_o].logprob) < tol
        assert same == len(r.token_ids), (quant, r.token_ids, o.token_ids)  # measured: 32 of 32 for both


def test_expert_quantization_options_are_validated(tiny_moe):
    from tokenmill.model.quantize import quantize_experts

    moe = load_model(tiny_moe["MixtralForCausalLM"][0])
    with pytest.raises(ValueError, match="expert_quantization must be one of int8, fp8_e4m3, fp8_e5m2"):
        quantize_experts(moe, "int4", 32)
    with pytest.raises(ValueError, match="expert_quantization_window=48 must divide hidden_size"):
        quantize_experts(moe, "int8", 48)
    q = quantize_experts(moe, "fp8_e5m2", 16)
    assert q.params["layers"]["w1"].dtype == np.dtype("float8_e5m2") and q.config.expert_quant_window == 16
    assert q.params["layers"]["w1_scale"].shape == (2, 8, 2, 64 // 16, 128)
    assert q.params["layers"]["w2_scale"].shape == (2, 8, 128 // 16, 64)
    dense = dataclasses.replace(moe, config=dataclasses.replace(moe.config, num_experts=0))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        quantize_experts(dense, "int8", 32)
