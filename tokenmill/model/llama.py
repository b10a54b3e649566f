"""The Llama family: Llama (incl. llama3 RoPE scaling), Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm), SmolLM.

Pure functions over a params pytree (layout in `tokenmill/model/loader`); per-layer weights are
stacked on a leading layer axis and the layer loop is a `lax.scan`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from tokenmill import envs
from tokenmill.config import ModelConfig
from tokenmill.ops.activations import get_activation
from tokenmill.ops.attention import AttentionMetadata, OutputRows, paged_attention, select_rows, write_kv
from tokenmill.ops.cpu import greedy_head
from tokenmill.ops.cpu.linear import STRIP, to_strips
from tokenmill.ops.linear import in_features, kernel_layout, kernel_runs, linear, takes_strips
from tokenmill.ops.moe import fused_moe, strips_suit
from tokenmill.ops.norms import rms_norm
from tokenmill.ops.rotary import apply_rotary, inv_frequencies, rope_attention_factor

# A window no context reaches: what full-attention layers use when others slide (one scan body).
NO_WINDOW = np.iinfo(np.int32).max // 2
# The dense projections of a layer, [L, K, N] each over the layers. They go through ops.linear,
# which reads a layer in place by its index (the C++ kernel on CPU; float32, or 8-bit with
# `--quantization`), rather than as the scan's per-layer slices.
LINEAR_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# Projections of the same input, stored side by side as one stack where the CPU kernel multiplies
# them (`to_kernel_layout`): one call, one pass of the threads and one wait instead of three or two.
# Each output column is the same sum either way.
FUSED = {"w_qkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


def param_specs(cfg: ModelConfig) -> dict:
    """PartitionSpecs: attention heads and MLP columns over the "model" axis (Megatron style)."""
    layers = {
        "attn_norm": P(None, None),
        "wq": P(None, None, "model"),
        "wk": P(None, None, "model"),
        "wv": P(None, None, "model"),
        "wo": P(None, "model", None),
        "mlp_norm": P(None, None),
    }
    if cfg.is_moe:  # experts over "model" (expert parallel), the router replicated
        layers.update(router=P(None, None, None), w1=P(None, "model", None, None, None), w2=P(None, "model", None, None))
        if cfg.moe_bias:
            layers.update(router_bias=P(None, None), b1=P(None, "model", None, None), b2=P(None, "model", None))
        if cfg.expert_quantization:
            layers.update(w1_scale=P(None, "model", None, None, None), w2_scale=P(None, "model", None, None))
    else:
        layers.update(w_gate=P(None, None, "model"), w_up=P(None, None, "model"), w_down=P(None, "model", None))
    if cfg.attention_bias:
        layers.update(bq=P(None, "model"), bk=P(None, "model"), bv=P(None, "model"))
    if cfg.o_proj_bias:
        layers.update(bo=P(None, None))
    if cfg.attention_sinks:
        layers.update(sinks=P(None, "model"))
    if cfg.qk_norm:
        layers.update(q_norm=P(None, None), k_norm=P(None, None))
    specs = {"embed": P(None, None), "final_norm": P(None), "layers": layers}
    if cfg.quantization:  # scales (and offsets) shard like their weights; the LM head is a stack of one
        layers.update({k + "_scale": layers[k] for k in LINEAR_WEIGHTS if k in layers})
        layers.update({k + "_offset": layers[k] for k in cfg.quant_offsets if k in layers})
        specs.update(lm_head_q=P(None, None, "model"), lm_head_q_scale=P(None, None, "model"))
        if "lm_head_q" in cfg.quant_offsets:
            specs["lm_head_q_offset"] = P(None, None, "model")
    elif not cfg.tie_word_embeddings:
        specs["lm_head"] = P(None, "model")
    return specs


def to_kernel_layout(params: dict, mesh, int16: bool = False) -> dict:
    """`params` placed on `mesh`, with each projection stack and a quantized LM head (and the float32
    experts of an MoE model) in the layout ops.linear (ops.moe) multiplies fastest there: the CPU
    kernels' strips, made once here rather than packed or strided through on every call, and the
    projections of one input side by side (FUSED). Consumes `params`: each array it converts is
    freed as soon as its new copy exists, so loading peaks at one fused stack above the model's size.
    `int16` (--quantization w8a16_int / gguf_int): int8 stacks and 4-bit strips go into the kernel's quad
    strips instead."""
    layers = dict(params["layers"])
    for fused, members in FUSED.items():
        if all(m in layers for m in members) and kernel_runs(layers[members[0]], mesh):
            for suffix in ("", "_scale", "_offset"):
                if members[0] + suffix not in layers:
                    continue
                parts = [layers.pop(m + suffix) for m in members]
                # N: axis 2 of [L, K, N] and of the scales; the strip axis 1 of 4-bit strips
                layers[fused + suffix] = jnp.concatenate(parts, axis=1 if parts[0].ndim == 4 else 2)
                for part in parts:
                    part.delete()
    for key in (*LINEAR_WEIGHTS, *FUSED):
        if key in layers:
            layers[key] = _replaced(layers[key], lambda w: kernel_layout(w, mesh, int16))
    if "w1" in layers and strips_suit(layers["w1"], layers["w2"], mesh):
        for key in ("w1", "w2"):
            layers[key] = _replaced(layers[key], jax.jit(to_strips))
    params = {**params, "layers": layers}
    if "lm_head_q" in params:  # a quantized LM head: a stack of one
        params["lm_head_q"] = _replaced(params["lm_head_q"], lambda w: kernel_layout(w, mesh, int16))
    elif "lm_head" in params or "embed" in params:
        # a float LM head in strips too where the kernel multiplies it; one tied to the embedding
        # replaces it, the lookup reading its rows from the strips (`embed_tokens`)
        name = "lm_head" if "lm_head" in params else "embed"
        tied = name == "embed"
        # converted from the head in one step, so that no transposed [1, D, V] copy is stored meanwhile
        if takes_strips(jax.eval_shape(lambda h: _head_stack(h, tied), params[name]), mesh):
            params["lm_head_strips"] = jax.jit(lambda h: to_strips(_head_stack(h, tied)))(params[name])
            params.pop(name).delete()
            if envs.TOKENMILL_GREEDY_HEAD and greedy_head.available():  # greedy steps' head (compute_logits)
                params["lm_head_screen"] = greedy_head.screen_head(params["lm_head_strips"])
    return params


def embed_tokens(params: dict, input_ids: jax.Array) -> jax.Array:
    """The embedding rows of `input_ids` [T] → [T, D]: from `embed` [V, D], or from the LM head's
    strips [1, V / 32, D, 32] that replaced the embedding it is tied to (token t: column t % 32 of
    strip t // 32)."""
    if "embed" in params:
        return params["embed"][input_ids]
    return params["lm_head_strips"][0, input_ids // STRIP, :, input_ids % STRIP]


def _head_stack(head: jax.Array, tied: bool) -> jax.Array:
    """The LM head as a stack of one [1, D, V], from the embedding [V, D] it is tied to or from [D, V]."""
    return (head.T if tied else head)[None]


def _replaced(array: jax.Array, convert) -> jax.Array:
    """convert(array), the input deleted if a new array came back."""
    converted = convert(array)
    if converted is not array:
        array.delete()
    return converted


def projections(cfg: ModelConfig, stacked: dict, layer, rows=None):
    """The layer's `project(x, *names, gated=None)`: x @ each named projection, read from its [L, K, N]
    stack by layer index (ops.linear), with its scales when it is quantized; names stored as one FUSED
    stack are multiplied in one call and split; `gated` (an activation): a gated MLP's (gate, up) as
    (act(x @ gate) * (x @ up),). x's rows from `rows` on are padding (ops.linear)."""
    widths = {"wq": cfg.num_heads * cfg.head_dim, "wk": cfg.num_kv_heads * cfg.head_dim,
              "wv": cfg.num_kv_heads * cfg.head_dim, "w_gate": cfg.intermediate_size, "w_up": cfg.intermediate_size}

    def multiply(name: str, x: jax.Array, gated: str | None = None) -> jax.Array:
        weights, scale = stacked[name], stacked.get(name + "_scale")
        wsz = (cfg.quant_window or in_features(weights)) if scale is not None else None
        return linear(x, weights, layer, scale, wsz, bf16=cfg.bf16_inputs, int16=cfg.int16_inputs,
                      offset=stacked.get(name + "_offset"), rows=rows, gated=gated).astype(x.dtype)

    def project(x: jax.Array, *names: str, gated: str | None = None) -> tuple[jax.Array, ...]:
        fused = next((f for f, members in FUSED.items() if members == names and f in stacked), None)
        if gated is not None:  # (gate, up) → (act(gate) * up,), fused: in the kernel where it can
            if fused is not None:
                return (multiply(fused, x, gated),)
            gate, up = (multiply(name, x) for name in names)
            return (get_activation(gated)(gate) * up,)
        if fused is None:
            return tuple(multiply(name, x) for name in names)
        ends = np.cumsum([widths[name] for name in names])
        return tuple(jnp.split(multiply(fused, x), ends[:-1], axis=1))

    return project


def attention_block(cfg: ModelConfig, w: dict, x, k_cache, v_cache, layer, md, inv_freq, scale, window, project=None,
                    out_rows: OutputRows | None = None, project_out=None):
    """Shared by the Llama-family and Gemma 3 layers: projections, q/k norm, RoPE, cache write, attention.
    `project(x, *names)` multiplies by projections (default: the layer's own `w[name]`). With
    `out_rows`, every row's K/V is written but only those rows attend and are projected out (by
    `project_out`, default `project`): the output is theirs, in out_rows.index order."""
    project = project or (lambda h, *names: tuple(h @ w[name] for name in names))
    project_out = project_out or project
    T = x.shape[0]
    q, k, v = project(x, "wq", "wk", "wv")
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
    if out_rows is not None:
        q, md = q[out_rows.index], select_rows(md, out_rows)
    o = paged_attention(q, k_cache, v_cache, layer, md, scale=scale, sliding_window=window, sinks=w.get("sinks"))
    (o,) = project_out(o.reshape(T, -1), "wo")
    if cfg.o_proj_bias:
        o = o + w["bo"]
    return o, k_cache, v_cache


def feed_forward(cfg: ModelConfig, w: dict, x: jax.Array, project) -> jax.Array:
    """The dense gated MLP, or the mixture of experts: route each token to its top-k experts."""
    if not cfg.is_moe:
        (hidden,) = project(x, "w_gate", "w_up", gated=cfg.hidden_act)
        return project(hidden, "w_down")[0]
    gating = jnp.dot(x, w["router"], preferred_element_type=jnp.float32)
    if cfg.moe_bias:
        gating = gating + w["router_bias"]
    scale1, scale2 = w.get("w1_scale"), w.get("w2_scale")  # sub-channel quantized experts
    mesh = jax.sharding.get_abstract_mesh()  # set by the runner: experts split over "model"
    expert_parallel = not mesh.empty and "model" in mesh.axis_names and mesh.shape["model"] > 1
    return fused_moe(
        x, w["w1"], w["w2"], gating, cfg.num_experts_per_tok,
        renormalize_topk_logits=cfg.norm_topk_prob, act_fn=cfg.moe_act, b1=w.get("b1"), b2=w.get("b2"),
        w1_scale=scale1, w2_scale=scale2,
        subc_quant_wsz=cfg.expert_quant_window or None,
        mesh=mesh if expert_parallel else None, swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit,
    )


def layer_windows(cfg: ModelConfig) -> tuple[int | None, jax.Array | None]:
    """(one window for every layer, or None) and, when layers differ, a per-layer window array."""
    sliding = cfg.sliding_layers()
    if not any(sliding):
        return None, None
    if all(sliding):
        return cfg.sliding_window, None
    return None, jnp.asarray(np.where(sliding, cfg.sliding_window, NO_WINDOW), jnp.int32)


def forward(
    params: dict, cfg: ModelConfig, k_cache: jax.Array, v_cache: jax.Array, input_ids: jax.Array,
    md: AttentionMetadata, out_rows: OutputRows | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Run the batch; returns (final hidden states [T, D] after the last norm, k_cache, v_cache): of
    every row, or with `out_rows` of rows out_rows.index (past out_rows.count: padding), whose last
    layer runs for those rows alone past its K/V write. Each row's state is the same bits either way:
    the kernels compute rows independently."""
    inv_freq = jnp.asarray(inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict))
    # YaRN scales cos and sin, i.e. q and k: the scores by its square
    scale = cfg.head_dim**-0.5 * rope_attention_factor(cfg.rope_scaling_dict) ** 2
    window, per_layer_window = layer_windows(cfg)
    x = embed_tokens(params, input_ids)
    # the projections stay whole (ops.linear indexes them); the rest is sliced by the scan
    stacked = {k: v for k, v in params["layers"].items()
               if k.removesuffix("_scale").removesuffix("_offset") in (*LINEAR_WEIGHTS, *FUSED)}
    per_layer = {k: v for k, v in params["layers"].items() if k not in stacked}

    def run_layer(x, k_cache, v_cache, layer, w, layer_window, out_rows=None):
        project = projections(cfg, stacked, layer, md.num_tokens)
        # past the K/V, the output rows only
        project_out = project if out_rows is None else projections(cfg, stacked, layer, out_rows.count)
        h = rms_norm(x, w["attn_norm"], cfg.rms_norm_eps)
        attn, k_cache, v_cache = attention_block(
            cfg, w, h, k_cache, v_cache, layer, md, inv_freq, scale, window if layer_window is None else layer_window,
            project, out_rows, project_out,
        )
        x = x + attn if out_rows is None else x[out_rows.index] + attn
        h = rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps)
        return x + feed_forward(cfg, w, h, project_out), k_cache, v_cache

    def layer_fn(carry, xs):
        x, k_cache, v_cache, layer = carry
        x, k_cache, v_cache = run_layer(x, k_cache, v_cache, layer, *xs)
        return (x, k_cache, v_cache, layer + 1), None

    layers = (per_layer, per_layer_window)
    carry = (x, k_cache, v_cache, jnp.int32(0))
    if out_rows is None:
        (x, k_cache, v_cache, _), _ = jax.lax.scan(layer_fn, carry, layers)
    else:  # the last layer out of the scan, for the output rows
        (x, k_cache, v_cache, layer), _ = jax.lax.scan(layer_fn, carry, jax.tree.map(lambda a: a[:-1], layers))
        x, k_cache, v_cache = run_layer(x, k_cache, v_cache, layer, *jax.tree.map(lambda a: a[-1], layers), out_rows)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), k_cache, v_cache


def compute_logits(params: dict, cfg: ModelConfig, hidden: jax.Array, greedy=None) -> jax.Array:
    """hidden [N, D] → float32 logits [N, V]. `greedy` (traced bool): the step takes only their argmax;
    then a float32 head with its screening copy (`lm_head_screen`) gives, for up to
    greedy_head.MAX_ROWS rows, values whose argmax is exactly the logits' (greedy_head.greedy_logits),
    reading the int8 copy instead of most of the float32 head."""
    if cfg.quantization:
        head = params["lm_head_q"]
        return linear(hidden, head, 0, params["lm_head_q_scale"], cfg.quant_window or in_features(head),
                      bf16=cfg.bf16_inputs, int16=cfg.int16_inputs, offset=params.get("lm_head_q_offset"))
    if "lm_head_strips" in params:
        strips = params["lm_head_strips"]
        if greedy is not None and "lm_head_screen" in params and hidden.shape[0] <= greedy_head.MAX_ROWS:
            return jax.lax.cond(greedy, lambda h: greedy_head.greedy_logits(h, strips, params["lm_head_screen"]),
                                lambda h: linear(h, strips, 0), hidden)
        return linear(hidden, strips, 0)
    lm_head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.dot(hidden, lm_head, preferred_element_type=jnp.float32)
