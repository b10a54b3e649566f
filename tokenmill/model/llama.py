"""The Llama family: Llama (incl. llama3 RoPE scaling), Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm), SmolLM.

Pure functions over a params pytree (layout in `tokenmill/model/loader`); per-layer weights are
stacked on a leading layer axis and the layer loop is a `lax.scan`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tokenmill.config import ModelConfig
from tokenmill.ops.activations import gated_mlp
from tokenmill.ops.attention import AttentionMetadata, paged_attention, write_kv
from tokenmill.ops.norms import rms_norm
from tokenmill.ops.rotary import apply_rotary, inv_frequencies


def param_specs(cfg: ModelConfig) -> dict:
    """PartitionSpecs: attention heads and MLP columns over the "model" axis (Megatron style)."""
    layers = {
        "attn_norm": P(None, None),
        "wq": P(None, None, "model"),
        "wk": P(None, None, "model"),
        "wv": P(None, None, "model"),
        "wo": P(None, "model", None),
        "mlp_norm": P(None, None),
        "w_gate": P(None, None, "model"),
        "w_up": P(None, None, "model"),
        "w_down": P(None, "model", None),
    }
    if cfg.attention_bias:
        layers.update(bq=P(None, "model"), bk=P(None, "model"), bv=P(None, "model"))
    if cfg.qk_norm:
        layers.update(q_norm=P(None, None), k_norm=P(None, None))
    specs = {"embed": P(None, None), "final_norm": P(None), "layers": layers}
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = P(None, "model")
    return specs


def attention_block(cfg: ModelConfig, w: dict, x, k_cache, v_cache, layer, md, inv_freq, scale, window):
    """Shared by the Llama-family and Gemma 3 layers: projections, q/k norm, RoPE, cache write, attention."""
    T = x.shape[0]
    q = x @ w["wq"]
    k = x @ w["wk"]
    v = x @ w["wv"]
    if cfg.attention_bias:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    q = q.reshape(T, cfg.num_heads, cfg.head_dim)
    k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
    q = apply_rotary(q, md.positions, inv_freq)
    k = apply_rotary(k, md.positions, inv_freq)
    k_cache, v_cache = write_kv(k_cache, v_cache, layer, k, v, md.slot_mapping)
    o = paged_attention(q, k_cache, v_cache, layer, md, scale=scale, sliding_window=window)
    return o.reshape(T, -1) @ w["wo"], k_cache, v_cache


def forward(
    params: dict, cfg: ModelConfig, k_cache: jax.Array, v_cache: jax.Array, input_ids: jax.Array,
    md: AttentionMetadata,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Run the batch; returns (final hidden states [T, D] after the last norm, k_cache, v_cache)."""
    inv_freq = jnp.asarray(inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict))
    scale = cfg.head_dim**-0.5
    window = cfg.sliding_window if any(cfg.sliding_layers()) else None
    x = params["embed"][input_ids]

    def layer_fn(carry, w):
        x, k_cache, v_cache, layer = carry
        h = rms_norm(x, w["attn_norm"], cfg.rms_norm_eps)
        attn, k_cache, v_cache = attention_block(cfg, w, h, k_cache, v_cache, layer, md, inv_freq, scale, window)
        x = x + attn
        h = rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps)
        x = x + gated_mlp(h, w["w_gate"], w["w_up"], w["w_down"], cfg.hidden_act)
        return (x, k_cache, v_cache, layer + 1), None

    (x, k_cache, v_cache, _), _ = jax.lax.scan(layer_fn, (x, k_cache, v_cache, jnp.int32(0)), params["layers"])
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), k_cache, v_cache


def compute_logits(params: dict, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """hidden [N, D] → float32 logits [N, V]."""
    lm_head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.dot(hidden, lm_head, preferred_element_type=jnp.float32)
