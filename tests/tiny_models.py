"""Tiny random checkpoints of each supported family, written as HF safetensors directories."""

from __future__ import annotations

import os

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 256
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

CONFIGS = {
    "LlamaForCausalLM": lambda: transformers.LlamaConfig(
        **_COMMON,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "MistralForCausalLM": lambda: transformers.MistralConfig(**_COMMON, sliding_window=16),
    "Qwen2ForCausalLM": lambda: transformers.Qwen2Config(**_COMMON),
    "Qwen3ForCausalLM": lambda: transformers.Qwen3Config(**_COMMON, head_dim=32),
    "Gemma3ForCausalLM": lambda: transformers.Gemma3TextConfig(
        **{**_COMMON, "num_hidden_layers": 3}, head_dim=32, sliding_window=16, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),
    "MixtralForCausalLM": lambda: transformers.MixtralConfig(**_COMMON, num_local_experts=8, num_experts_per_tok=2),
    "Qwen3MoeForCausalLM": lambda: transformers.Qwen3MoeConfig(
        **_COMMON, head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=False,
    ),
    "GptOssForCausalLM": lambda: transformers.GptOssConfig(
        **{**_COMMON, "num_hidden_layers": 3}, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=16, swiglu_limit=1.0,  # a low limit, so the clamps of swigluoai act
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
    ),
}
# gpt-oss' attention sinks need the eager attention of transformers
_ATTN_IMPL = {"GptOssForCausalLM": "eager"}


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


def make_tiny_checkpoint(arch: str, path: str, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Write a random `arch` model (config fields `overrides` changed) and a word-level tokenizer to
    `path`; returns the torch model."""
    torch.manual_seed(seed)
    config = CONFIGS[arch]()
    for key, value in overrides.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=_ATTN_IMPL.get(arch)).eval()
    with torch.no_grad():  # biases and sinks start at 0 (or near it): give them values that matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("sinks"):
                p.normal_(0.0, 0.5)
    os.makedirs(path, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    tiny_tokenizer().save_pretrained(path)
    return model
