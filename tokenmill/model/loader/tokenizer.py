"""Tokenizers: from an HF directory, or rebuilt from a GGUF file's metadata.

For GGUF we use transformers' own converter (`convert_gguf_tokenizer`) so our tokens match what
`AutoTokenizer.from_pretrained(dir, gguf_file=...)` produces, but we feed it metadata from our own
reader: transformers' GGUF metadata reader (`integrations/gguf/reader.py`) imports torch, and the
runtime must not need torch.
"""

from __future__ import annotations

from typing import Any

from .errors import ModelLoadError

# GGUF metadata key (after "tokenizer.") -> the name transformers' converter expects
_GGUF_TOKENIZER_KEYS = {
    "ggml.model": "tokenizer_type",
    "ggml.pre": "pre_tokenizer_type",
    "ggml.tokens": "tokens",
    "ggml.scores": "scores",
    "ggml.token_type": "token_type",
    "ggml.merges": "merges",
    "ggml.precompiled_charsmap": "precompiled_charsmap",
    "ggml.bos_token_id": "bos_token_id",
    "ggml.eos_token_id": "eos_token_id",
    "ggml.unknown_token_id": "unk_token_id",
    "ggml.padding_token_id": "pad_token_id",
    "ggml.add_space_prefix": "add_prefix_space",
}
_GGUF_TOKENIZER_CONFIG_KEYS = {"ggml.add_bos_token": "add_bos_token", "ggml.add_eos_token": "add_eos_token"}
_SPECIAL_TOKEN_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def hf_tokenizer(path: str):
    """(tokenizer, chat_template) from an HF directory's tokenizer files."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... depending on what is wrong
        why = " ".join(str(e).split())  # some of transformers' messages span lines
        raise ModelLoadError(
            f"{path}: cannot build a tokenizer from this directory ({type(e).__name__}: {why}); "
            "expected tokenizer.json (or files transformers can convert) with tokenizer_config.json"
        ) from None
    if not getattr(tok, "is_fast", False):
        raise ModelLoadError(f"{path}: the tokenizer is not a fast (Rust) tokenizer: {type(tok).__name__}")
    return tok, tok.chat_template


def gguf_tokenizer(path: str, metadata: dict[str, Any]):
    """(tokenizer, chat_template) from a GGUF file's `tokenizer.*` metadata."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    if "tokenizer.ggml.tokens" not in metadata:
        raise ModelLoadError(f"{path}: this GGUF file has no tokenizer (no tokenizer.ggml.tokens metadata)")
    tokenizer_dict = {
        name: metadata[f"tokenizer.{key}"] for key, name in _GGUF_TOKENIZER_KEYS.items() if f"tokenizer.{key}" in metadata
    }
    init_kwargs: dict[str, Any] = {
        name: metadata[f"tokenizer.{key}"]
        for key, name in _GGUF_TOKENIZER_CONFIG_KEYS.items()
        if f"tokenizer.{key}" in metadata
    }
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # as transformers (and llama.cpp) do: a sentencepiece vocabulary that does not say adds BOS
        init_kwargs.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tokens):
            init_kwargs[name] = tokens[token_id]
    arch = metadata.get("general.architecture", "")
    try:
        backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, **init_kwargs, **extra)
    except Exception as e:
        raise ModelLoadError(
            f"{path}: cannot build a tokenizer from the GGUF metadata "
            f"(tokenizer.ggml.model={tokenizer_dict.get('tokenizer_type')!r}): {type(e).__name__}: {e}"
        ) from None
    chat_template = metadata.get("tokenizer.chat_template")
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok, chat_template
