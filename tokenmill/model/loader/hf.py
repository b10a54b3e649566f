"""HF checkpoint directories: config.json + safetensors (one file or sharded with an index)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from tokenmill.config import ModelConfig

from .errors import ModelLoadError
from .hf_experts import ROUTER_NAMES, HFExperts
from .layout import assemble

# Gemma3ForConditionalGeneration keeps the text model under a prefix (two spellings across
# transformers versions); the vision tower's tensors match no prefix we ask for and are ignored.
_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head."))

_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "bo": "self_attn.o_proj.bias",  # gpt-oss
    "sinks": "self_attn.sinks",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",  # gemma3
    "post_ffn_norm": "post_feedforward_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
_TOP_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON ({e})") from None


def load_hf_config(path: str) -> ModelConfig:
    """ModelConfig from config.json, with EOS ids from generation_config.json merged in."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(
            f"{path}: no config.json; a model directory needs config.json and *.safetensors "
            "(HF format), or pass a .gguf file"
        )
    d = _read_json(cfg_path)
    if not isinstance(d, dict):
        raise ModelLoadError(f"{cfg_path}: expected a JSON object")
    eos: list[int] = []
    for src in (d.get("text_config") or {}, d):
        eos += _ids(src.get("eos_token_id"))
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        eos += _ids(_read_json(gen_path).get("eos_token_id"))
    try:
        return ModelConfig.from_hf_dict(d, eos_token_ids=tuple(dict.fromkeys(eos)))
    except ValueError as e:
        raise ModelLoadError(f"{cfg_path}: {e}") from None
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"{cfg_path}: incomplete model config (missing or bad {e})") from None


def _ids(v) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, list) else [int(v)]


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: no weight_map")
        files = [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
        for f in files:
            if not os.path.isfile(f):
                raise ModelLoadError(f"{index}: lists shard {os.path.basename(f)!r}, which is missing")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(
            f"{path}: no *.safetensors weights (supported: safetensors, single or sharded with "
            "model.safetensors.index.json; PyTorch .bin checkpoints are not supported)"
        )
    return files


class _SafetensorsSource:
    """Every tensor of a directory's safetensors files, by name with any multimodal prefix removed."""

    def __init__(self, path: str, stack: contextlib.ExitStack):
        self.where = path
        self._where_is: dict[str, tuple[Any, str]] = {}
        for f in _weight_files(path):
            try:
                handle = stack.enter_context(safe_open(f, framework="np"))
                keys = list(handle.keys())
            except (SafetensorError, OSError, ValueError) as e:
                raise ModelLoadError(f"{f}: corrupt or truncated safetensors file ({e})") from None
            for k in keys:
                self._where_is[_strip_prefix(k)] = (handle, k)

    def shape(self, name: str):
        if name not in self._where_is:
            return None
        handle, key = self._where_is[name]
        return tuple(handle.get_slice(key).get_shape())

    def read(self, name: str) -> np.ndarray:
        handle, key = self._where_is[name]
        try:
            return handle.get_tensor(key)
        except (SafetensorError, TypeError, ValueError) as e:  # e.g. a dtype numpy cannot hold
            raise ModelLoadError(f"{self.where}: cannot read tensor {name!r} ({e})") from None


def _strip_prefix(k: str) -> str:
    for old, new in _PREFIXES:
        if k.startswith(old):
            return new + k[len(old):]
    return k


def load_hf_params(path: str, cfg: ModelConfig, dtype) -> dict:
    gemma = cfg.family == "gemma3"

    def tensor_name(key: str, i: int | None) -> str:
        if i is None:
            return _TOP_NAMES[key]
        if key == "mlp_norm":  # the norm in front of the MLP has a different name per family
            leaf = "pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight"
        elif key in ("router", "router_bias"):
            leaf = ROUTER_NAMES[cfg.architecture][key == "router_bias"]
        else:
            leaf = _LAYER_NAMES[key]
        return f"model.layers.{i}.{leaf}"

    with contextlib.ExitStack() as stack:
        source = _SafetensorsSource(path, stack)
        experts = HFExperts(cfg, source) if cfg.is_moe else None
        return assemble(cfg, source, tensor_name, dtype, norm_offset=1.0, experts=experts)
