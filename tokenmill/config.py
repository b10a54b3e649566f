"""Configuration: small frozen dataclasses, one per area. A component takes the part it needs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Architectures tokenmill can run, by their HF `architectures[0]` name.
LLAMA_FAMILY = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
GEMMA3_FAMILY = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
SUPPORTED_ARCHITECTURES = LLAMA_FAMILY + GEMMA3_FAMILY


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, normalised from an HF `config.json` (or GGUF metadata)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # dict items, hashable
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of sliding-window layers
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3 and Gemma 3: RMSNorm over each head of q and k
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # "full_attention" | "sliding_attention" per layer
    query_pre_attn_scalar: float | None = None  # Gemma 3: attention scale = this ** -0.5
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def family(self) -> str:
        return "gemma3" if self.architecture in GEMMA3_FAMILY else "llama"

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: does it attend through a sliding window?"""
        if not self.sliding_window:
            return (False,) * self.num_layers
        if self.layer_types:
            return tuple(t == "sliding_attention" for t in self.layer_types)
        return (True,) * self.num_layers

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        archs = d.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if "text_config" in d:  # multimodal wrapper (Gemma3ForConditionalGeneration): keep the text part
            d = {**d["text_config"], "architectures": ["Gemma3ForCausalLM"]}
            arch = "Gemma3ForCausalLM"
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta", 10000.0)
        rope_parameters = d.get("rope_parameters")  # transformers >= 5 moves RoPE settings here
        local_theta = d.get("rope_local_base_freq")
        if isinstance(rope_parameters, dict):
            if "full_attention" in rope_parameters:  # per-layer-type parameters (Gemma 3)
                full = rope_parameters["full_attention"]
                local_theta = rope_parameters.get("sliding_attention", {}).get("rope_theta", local_theta)
            else:
                full = rope_parameters
            rope_theta = full.get("rope_theta", rope_theta)
            if full.get("rope_type", "default") != "default":
                rope_scaling = full
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        eos = d.get("eos_token_id")
        if not eos_token_ids and eos is not None:
            eos_token_ids = tuple(eos) if isinstance(eos, list) else (eos,)
        is_gemma = arch in GEMMA3_FAMILY
        sliding_window = d.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not d.get("use_sliding_window", False):
            sliding_window = None
        layer_types = tuple(d.get("layer_types") or ())
        if is_gemma and not layer_types:
            pattern = d.get("sliding_window_pattern", 6)
            layer_types = tuple(
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(d["num_hidden_layers"])
            )
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rope_theta=float(rope_theta),
            rope_scaling=tuple(sorted(rope_scaling.items())) if rope_scaling else None,
            rope_local_theta=float(local_theta) if is_gemma and local_theta else (10000.0 if is_gemma else None),
            tie_word_embeddings=d.get("tie_word_embeddings", is_gemma),
            attention_bias=d.get("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm=arch == "Qwen3ForCausalLM" or is_gemma,
            hidden_act=d.get("hidden_activation") or d.get("hidden_act") or "silu",
            sliding_window=sliding_window,
            layer_types=layer_types,
            query_pre_attn_scalar=d.get("query_pre_attn_scalar") if is_gemma else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(eos_token_ids),
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # KV cache size: bytes, or None to take `kv_cache_memory_fraction` of the free memory
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float = 0.3
    num_blocks: int | None = None  # overrides the memory budget (tests)


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # path (HF directory or .gguf file); None = the embedded default
    dtype: str = "auto"  # "auto" = float32 on CPU, bfloat16 on GPU/TPU
    seed: int = 0
    # launch step N+1 before collecting step N (EngineCore.step_with_batch_queue)
    async_scheduling: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def replace(self, **kw) -> EngineConfig:
        return dataclasses.replace(self, **kw)


_ENGINE_ARGS = {"dtype", "seed", "async_scheduling"}


def engine_config_from_kwargs(model: str | None, **kwargs) -> tuple[EngineConfig, bool]:
    """vLLM-style engine arguments → (EngineConfig, enable_prefix_caching)."""
    prefix_caching = kwargs.pop("enable_prefix_caching", True)
    if "num_gpu_blocks_override" in kwargs:
        kwargs["num_blocks"] = kwargs.pop("num_gpu_blocks_override")
    cache_args = {f.name for f in dataclasses.fields(CacheConfig)}
    sched_args = {f.name for f in dataclasses.fields(SchedulerConfig)}
    unknown = set(kwargs) - cache_args - sched_args - _ENGINE_ARGS
    if unknown:
        known = sorted(cache_args | sched_args | _ENGINE_ARGS | {"enable_prefix_caching"})
        raise TypeError(f"unknown engine argument(s) {sorted(unknown)}; known: {', '.join(known)}")
    cache = CacheConfig(**{k: v for k, v in kwargs.items() if k in cache_args})
    sched = SchedulerConfig(**{k: v for k, v in kwargs.items() if k in sched_args})
    engine = {k: v for k, v in kwargs.items() if k in _ENGINE_ARGS}
    return EngineConfig(model=model, cache=cache, scheduler=sched, **engine), prefix_caching
