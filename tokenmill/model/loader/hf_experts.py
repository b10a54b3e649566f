"""Mixture-of-experts tensors of HF checkpoints, assembled into params orientation (layout.EXPERTS).

Two layouts exist on the Hub:
- one tensor per expert and projection (Mixtral `block_sparse_moe.experts.{j}.w1/w3/w2`, Qwen3-MoE
  `mlp.experts.{j}.gate_proj/up_proj/down_proj`), each [out, in];
- fused per layer (gpt-oss `mlp.experts.gate_up_proj` [E, D, 2F] with gate and up interleaved
  column by column, `down_proj` [E, F, D], and their biases), already [in, out].
"""

from __future__ import annotations

import numpy as np

from tokenmill.config import ModelConfig

from .errors import ModelLoadError
from .layout import Source

# per-expert layouts: (expert prefix under the layer, gate, up, down)
_PER_EXPERT = {
    "MixtralForCausalLM": ("block_sparse_moe.experts.{j}.", "w1.weight", "w3.weight", "w2.weight"),
    "Qwen3MoeForCausalLM": ("mlp.experts.{j}.", "gate_proj.weight", "up_proj.weight", "down_proj.weight"),
}
_FUSED = {  # gpt-oss: params key -> tensor under "mlp.experts."
    "w1": "gate_up_proj", "w2": "down_proj", "b1": "gate_up_proj_bias", "b2": "down_proj_bias",
}
ROUTER_NAMES = {  # the router (gate) of each MoE architecture, under the layer
    "MixtralForCausalLM": ("block_sparse_moe.gate.weight", None),
    "Qwen3MoeForCausalLM": ("mlp.gate.weight", None),
    "GptOssForCausalLM": ("mlp.router.weight", "mlp.router.bias"),
}


class HFExperts:
    """layout.Experts over a safetensors Source."""

    def __init__(self, cfg: ModelConfig, source: Source):
        self.cfg, self.source = cfg, source
        if cfg.architecture not in _PER_EXPERT and cfg.architecture != "GptOssForCausalLM":
            raise ModelLoadError(f"{source.where}: no expert layout known for {cfg.architecture}")

    def _name(self, layer: int, leaf: str) -> str:
        return f"model.layers.{layer}.{leaf}"

    def _parts(self, key: str, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        """(tensor name, expected shape in the checkpoint) of every tensor making up `key`."""
        c = self.cfg
        e, d, f = c.num_experts, c.hidden_size, c.moe_intermediate_size
        if c.architecture == "GptOssForCausalLM":
            shape = {"w1": (e, d, 2 * f), "w2": (e, f, d), "b1": (e, 2 * f), "b2": (e, d)}[key]
            return [(self._name(layer, "mlp.experts." + _FUSED[key]), shape)]
        prefix, gate, up, down = _PER_EXPERT[c.architecture]
        leaves = [gate, up] if key == "w1" else [down]
        shape = (f, d) if key == "w1" else (d, f)
        return [(self._name(layer, prefix.format(j=j) + leaf), shape) for j in range(e) for leaf in leaves]

    def check(self, key: str, layer: int, shape: tuple[int, ...]) -> None:
        for name, expect in self._parts(key, layer):
            got = self.source.shape(name)
            if got is None:
                hint = ""
                if self.source.shape(name + "_blocks") is not None:
                    hint = " (MXFP4-quantized experts are not supported; use a dequantized bf16/fp32 checkpoint)"
                raise ModelLoadError(f"{self.source.where}: missing tensor {name!r}{hint}")
            if tuple(got) != expect:
                raise ModelLoadError(
                    f"{self.source.where}: tensor {name!r} has shape {tuple(got)}, but the model config "
                    f"(num_experts={self.cfg.num_experts}, hidden_size={self.cfg.hidden_size}, "
                    f"expert intermediate size={self.cfg.moe_intermediate_size}) needs {expect}"
                )

    def read(self, key: str, layer: int) -> np.ndarray:
        c = self.cfg
        e, d, f = c.num_experts, c.hidden_size, c.moe_intermediate_size
        parts = [self.source.read(name) for name, _ in self._parts(key, layer)]
        if c.architecture == "GptOssForCausalLM":
            (t,) = parts
            if key == "w1":  # [E, D, 2F], columns gate0 up0 gate1 up1 ... -> [E, 2, D, F]
                return t.reshape(e, d, f, 2).transpose(0, 3, 1, 2)
            if key == "b1":
                return t.reshape(e, f, 2).transpose(0, 2, 1)
            return t
        if key == "w1":  # per expert: gate [F, D] and up [F, D] -> [E, 2, D, F]
            return np.stack([np.stack([g.T, u.T]) for g, u in zip(parts[0::2], parts[1::2])])
        return np.stack([p.T for p in parts])  # down [D, F] per expert -> [E, F, D]
