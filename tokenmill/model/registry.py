"""Model registry: HF architecture name → the module implementing its family."""

from __future__ import annotations

from types import ModuleType

from tokenmill.config import GEMMA3_FAMILY, LLAMA_FAMILY, SUPPORTED_ARCHITECTURES, ModelConfig


def get_model_module(cfg: ModelConfig) -> ModuleType:
    """The module with `forward(params, cfg, k_cache, v_cache, input_ids, md)`, `compute_logits(params, cfg, hidden)`,
    `param_specs(cfg)` and `to_kernel_layout(params, mesh, int16)` (placed params → the layout its kernels read)."""
    if cfg.architecture in LLAMA_FAMILY:
        from tokenmill.model import llama

        return llama
    if cfg.architecture in GEMMA3_FAMILY:
        from tokenmill.model import gemma3

        return gemma3
    raise ValueError(
        f"unsupported model architecture {cfg.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
