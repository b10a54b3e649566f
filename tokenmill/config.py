"""Configuration: small frozen dataclasses, one per area. A component takes the part it needs."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

# Architectures tokenmill can run, by their HF `architectures[0]` name.
LLAMA_FAMILY = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    # the same decoder with a mixture-of-experts feed-forward (tokenmill/ops/moe.py)
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
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
    # Mixture of experts: num_experts == 0 means a dense gated MLP in every layer
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    moe_act: str = "silu"  # "silu" | "gelu" | "swigluoai" (gpt-oss)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    moe_bias: bool = False  # gpt-oss: biases on the router and on both expert projections
    o_proj_bias: bool = False  # gpt-oss: `attention_bias` covers the output projection too
    attention_sinks: bool = False  # gpt-oss: a learned per-head logit in every softmax denominator
    # set when the experts were quantized at load time (tokenmill/model/quantize.py): "int8",
    # "fp8_e4m3" or "fp8_e5m2", with one scale per `expert_quant_window` rows of the reduction axis
    expert_quantization: str | None = None
    expert_quant_window: int = 0
    # set when the dense projections and the LM head were quantized at load time (`--quantization`):
    # "int8", "fp8_e4m3", "fp8_e5m2", "w8a16" or "w8a16_int", one scale per `quant_window` rows of each
    # reduction axis
    quantization: str | None = None
    quant_window: int = 0
    # "gguf" / "gguf_int" (a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks kept as they are; gguf_int: inputs
    # quantized to 16-bit integers): the stacks held as 4-bit
    # codes, which carry an offset per window besides the scale ("lm_head_q" for the LM head)
    quant_offsets: tuple[str, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def bf16_inputs(self) -> bool:
        """--quantization w8a16: each projection's input rounded to bfloat16 (ops.linear's `bf16`)."""
        return self.quantization == "w8a16"

    @property
    def int16_inputs(self) -> bool:
        """--quantization w8a16_int / gguf_int: each projection's input quantized to 16-bit integers
        (ops.linear's `int16`)."""
        return self.quantization in ("w8a16_int", "gguf_int")

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
        if arch.startswith("Qwen") and not d.get("use_sliding_window", False):
            sliding_window = None
        moe = _moe_fields(arch, d)
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
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") or is_gemma,
            hidden_act=d.get("hidden_activation") or d.get("hidden_act") or "silu",
            sliding_window=sliding_window,
            layer_types=layer_types,
            query_pre_attn_scalar=d.get("query_pre_attn_scalar") if is_gemma else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(eos_token_ids),
            **moe,
        )


def _moe_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of ModelConfig for an MoE architecture ({} for dense ones)."""
    if arch == "MixtralForCausalLM":
        return dict(num_experts=d["num_local_experts"], num_experts_per_tok=d["num_experts_per_tok"],
                    moe_intermediate_size=d["intermediate_size"], norm_topk_prob=True,
                    moe_act=d.get("hidden_act", "silu"))
    if arch == "Qwen3MoeForCausalLM":
        # every layer must be an MoE layer: the layers are one stacked scan body
        if d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1:
            raise ValueError(
                "Qwen3-MoE configs with dense layers (mlp_only_layers / decoder_sparse_step != 1) "
                "are not supported"
            )
        # Hub configs say num_experts; transformers 5 writes its alias num_local_experts
        num_experts = d["num_experts"] if "num_experts" in d else d["num_local_experts"]
        return dict(num_experts=num_experts, num_experts_per_tok=d["num_experts_per_tok"],
                    moe_intermediate_size=d["moe_intermediate_size"],
                    norm_topk_prob=d.get("norm_topk_prob", False), moe_act=d.get("hidden_act", "silu"))
    if arch == "GptOssForCausalLM":
        # routing: softmax over the top-k router logits == softmax, top-k, renormalise
        return dict(num_experts=d["num_local_experts"], num_experts_per_tok=d["num_experts_per_tok"],
                    moe_intermediate_size=d["intermediate_size"], norm_topk_prob=True, moe_act="swigluoai",
                    swiglu_alpha=d.get("swiglu_alpha", 1.702), swiglu_limit=d.get("swiglu_limit", 7.0),
                    moe_bias=True, o_proj_bias=d.get("attention_bias", True), attention_sinks=True)
    return {}


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # KV cache size: bytes, or None to take `kv_cache_memory_fraction` of the free memory
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float = 0.3
    num_blocks: int | None = None  # overrides the memory budget (tests)
    # the caches' element type: "auto" = the compute dtype; "bfloat16" halves a float32 model's KV bytes
    # (what decode attention reads each step; llama.cpp keeps its cache in 16 bits by default too)
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


@dataclass(frozen=True)
class ParallelConfig:
    """How one engine spreads over devices, processes and hosts (vLLM's argument names)."""

    tensor_parallel_size: int = 1  # devices of one mesh's "model" axis: heads and MLP columns split
    data_parallel_size: int = 1  # engine-core processes, each with its own replica and requests
    enable_expert_parallel: bool = False  # MoE experts split over "model" instead of their columns
    # None: in-process; "ray": workers as Ray actors (also TOKENMILL_MULTIHOST_BACKEND=ray)
    distributed_executor_backend: str | None = None
    # where the data-parallel engine cores run: "mp" local processes, "ray" Ray actors
    data_parallel_backend: str = "mp"

    def __post_init__(self):
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {self.data_parallel_size!r}")
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValueError(f"data_parallel_backend must be 'mp' or 'ray', got {self.data_parallel_backend!r}")
        if self.distributed_executor_backend not in (None, "ray"):
            raise ValueError(
                f"distributed_executor_backend must be None (in-process) or 'ray', "
                f"got {self.distributed_executor_backend!r}"
            )


SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): each decode step of a request also
    computes up to `num_speculative_tokens` proposed tokens and keeps those the model itself picks
    (core/scheduler.py says how), so one read of the weights can yield several tokens.

    "ngram" (prompt lookup) proposes the tokens that followed the latest earlier occurrence of the
    context's last n tokens, trying n from `prompt_lookup_max` down to `prompt_lookup_min`.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a config, a dict or a JSON object string (the CLI's `--speculative-config`)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # path (HF directory or .gguf file); None = the embedded default
    dtype: str = "auto"  # "auto" = float32 on CPU, bfloat16 on GPU/TPU
    seed: int = 0
    # launch step N+1 before collecting step N (EngineCore.step_with_batch_queue)
    async_scheduling: bool = True
    # quantize the experts of an MoE model at load time: "int8" | "fp8_e4m3" | "fp8_e5m2"
    expert_quantization: str | None = None
    expert_quantization_window: int = 256  # rows of the reduction axis per scale
    # store the dense projections and the LM head in 8 bits at load time: "int8" | "fp8_e4m3" | "fp8_e5m2",
    # or "w8a16" (int8 weights, inputs rounded to bfloat16), or "w8a16_int" (int8 weights, inputs
    # quantized to 16-bit integers per window); or keep a GGUF file's Q8_0 / Q4_0 / Q4_1
    # blocks as they are: "gguf" (inputs float32) or "gguf_int" (inputs quantized to 16-bit integers)
    quantization: str | None = None
    speculative_config: SpeculativeConfig | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def replace(self, **kw) -> EngineConfig:
        return dataclasses.replace(self, **kw)

    def with_absolute_model_path(self) -> EngineConfig:
        """This config with the model path made absolute, for processes with another working directory."""
        if self.model is not None and os.path.exists(path := os.path.expanduser(self.model)):
            return self.replace(model=os.path.abspath(path))
        return self


_ENGINE_ARGS = {"dtype", "seed", "async_scheduling", "expert_quantization", "expert_quantization_window",
                "quantization", "speculative_config"}


def engine_config_from_kwargs(model: str | None, **kwargs) -> tuple[EngineConfig, bool]:
    """vLLM-style engine arguments → (EngineConfig, enable_prefix_caching)."""
    prefix_caching = kwargs.pop("enable_prefix_caching", True)
    if "num_gpu_blocks_override" in kwargs:
        kwargs["num_blocks"] = kwargs.pop("num_gpu_blocks_override")
    parts = {name: {f.name for f in dataclasses.fields(cls)}
             for name, cls in (("cache", CacheConfig), ("scheduler", SchedulerConfig), ("parallel", ParallelConfig))}
    known = set(_ENGINE_ARGS).union(*parts.values())
    unknown = set(kwargs) - known
    if unknown:
        raise TypeError(
            f"unknown engine argument(s) {sorted(unknown)}; known: {', '.join(sorted(known | {'enable_prefix_caching'}))}"
        )
    cache = CacheConfig(**{k: v for k, v in kwargs.items() if k in parts["cache"]})
    sched = SchedulerConfig(**{k: v for k, v in kwargs.items() if k in parts["scheduler"]})
    parallel = ParallelConfig(**{k: v for k, v in kwargs.items() if k in parts["parallel"]})
    engine = {k: v for k, v in kwargs.items() if k in _ENGINE_ARGS}
    if "speculative_config" in engine:
        engine["speculative_config"] = SpeculativeConfig.from_value(engine["speculative_config"])
    config = EngineConfig(model=model, cache=cache, scheduler=sched, parallel=parallel, **engine)
    return config, prefix_caching
