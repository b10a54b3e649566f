"""The device mesh an engine runs on: axes ("data", "model") over the devices it owns.

Weights and the KV cache carry PartitionSpecs over "model" (`param_specs` of each model,
`KV_CACHE_SPEC` of the runner): attention heads, KV heads and MLP columns split Megatron style
(tensor parallel), or MoE experts split whole (expert parallel). XLA's SPMD partitioner inserts
the collectives. "data" has size 1 inside an engine: data parallelism is one engine core per
replica (tokenmill/engine), each with its own mesh.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from tokenmill.config import ModelConfig

MESH_AXES = ("data", "model")


def make_mesh(tensor_parallel_size: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (1, tensor_parallel_size) mesh over the first devices of `devices` (default: all of JAX's)."""
    devices = list(jax.devices() if devices is None else devices)
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs as many devices, but only {len(devices)} "
            f"{devices[0].platform.upper()} device(s) are visible"
        )
    return Mesh(np.array(devices[:tensor_parallel_size]).reshape(1, tensor_parallel_size), MESH_AXES)


def is_unsharded(mesh) -> bool:
    """Whether arrays placed over `mesh` (a Mesh or an abstract mesh; empty: none set) are whole on
    one device, i.e. a kernel that XLA cannot partition may take them as they are."""
    return jax.device_count() == 1 if mesh.empty else all(size == 1 for size in mesh.shape.values())


def check_model_fits(cfg: ModelConfig, tensor_parallel_size: int, enable_expert_parallel: bool) -> None:
    """Raise ValueError unless every tensor sharded over "model" splits evenly `tensor_parallel_size` ways."""
    tp = tensor_parallel_size
    if tp == 1:
        return
    split = {"attention heads": cfg.num_heads, "KV heads": cfg.num_kv_heads}
    if cfg.is_moe:
        if not enable_expert_parallel:
            raise ValueError(
                f"{cfg.architecture} is a mixture-of-experts model: with tensor_parallel_size={tp} its experts "
                "are split over the devices whole, which needs enable_expert_parallel (--enable-expert-parallel)"
            )
        split["experts"] = cfg.num_experts
    else:
        split["MLP intermediate size"] = cfg.intermediate_size
    if not cfg.tie_word_embeddings:
        split["vocabulary (lm_head columns)"] = cfg.vocab_size
    bad = [f"{name} {n}" for name, n in split.items() if n % tp]
    if bad:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the model's {', '.join(bad)}; "
            f"sizes that divide them all: {', '.join(str(d) for d in _divisors_of_all(split.values()))}"
        )


def _divisors_of_all(values) -> list[int]:
    g = int(np.gcd.reduce(np.array(list(values))))
    return [d for d in range(1, g + 1) if g % d == 0]
