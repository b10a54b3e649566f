"""Gemma 3 (text): sliding-window and global layers, GeGLU, pre/post norms, scaled embeddings, q/k norm.

Norm weights are the effective multipliers (`1 + w` of HF), folded in by the loader.
Sliding layers use RoPE base `rope_local_theta`, global ones `rope_theta` (and its scaling).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from tokenmill.config import ModelConfig
from tokenmill.model import llama
from tokenmill.ops.activations import gated_mlp
from tokenmill.ops.attention import AttentionMetadata, OutputRows
from tokenmill.ops.norms import rms_norm
from tokenmill.ops.rotary import inv_frequencies

def param_specs(cfg: ModelConfig) -> dict:
    specs = llama.param_specs(cfg)
    specs["layers"].update(post_attn_norm=P(None, None), post_ffn_norm=P(None, None))
    return specs


def to_kernel_layout(params: dict, mesh, int16: bool = False) -> dict:
    """`params` as placed: Gemma 3's projections are the scan's per-layer slices, multiplied by XLA."""
    return params


def forward(
    params: dict, cfg: ModelConfig, k_cache: jax.Array, v_cache: jax.Array, input_ids: jax.Array,
    md: AttentionMetadata, out_rows: OutputRows | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Run the batch; returns (final hidden states [T, D] after the last norm, k_cache, v_cache), as
    llama.forward (every layer runs for every row here: out_rows only picks the rows returned)."""
    sliding = np.asarray(cfg.sliding_layers())
    inv_global = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
    inv_local = inv_frequencies(cfg.head_dim, cfg.rope_local_theta)
    per_layer = {
        "inv_freq": jnp.asarray(np.where(sliding[:, None], inv_local[None], inv_global[None])),
        "window": jnp.asarray(np.where(sliding, cfg.sliding_window or llama.NO_WINDOW, llama.NO_WINDOW), jnp.int32),
    }
    scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
    x = params["embed"][input_ids]
    x = x * jnp.asarray(cfg.hidden_size**0.5, dtype=x.dtype)

    def layer_fn(carry, xs):
        x, k_cache, v_cache, layer = carry
        w, lp = xs
        h = rms_norm(x, w["attn_norm"], cfg.rms_norm_eps)
        attn, k_cache, v_cache = llama.attention_block(
            cfg, w, h, k_cache, v_cache, layer, md, lp["inv_freq"], scale, lp["window"]
        )
        x = x + rms_norm(attn, w["post_attn_norm"], cfg.rms_norm_eps)
        h = rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps)
        h = gated_mlp(h, w["w_gate"], w["w_up"], w["w_down"], cfg.hidden_act)
        x = x + rms_norm(h, w["post_ffn_norm"], cfg.rms_norm_eps)
        return (x, k_cache, v_cache, layer + 1), None

    carry = (x, k_cache, v_cache, jnp.int32(0))
    (x, k_cache, v_cache, _), _ = jax.lax.scan(layer_fn, carry, (params["layers"], per_layer))
    if out_rows is not None:
        x = x[out_rows.index]
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), k_cache, v_cache


compute_logits = llama.compute_logits  # tied embeddings, no final soft-capping in Gemma 3
