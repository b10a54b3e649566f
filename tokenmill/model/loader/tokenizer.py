"""Tokenizers: from an HF directory, or rebuilt from a GGUF file's metadata.

For GGUF we use transformers' own converter (`convert_gguf_tokenizer`) so our tokens match what
`AutoTokenizer.from_pretrained(dir, gguf_file=...)` produces, but we feed it metadata from our own
reader: transformers' GGUF metadata reader (`integrations/gguf/reader.py`) imports torch, and the
runtime must not need torch. The converted tokenizer is kept in TOKENMILL_TOKENIZER_CACHE_DIR, one
per file (its path, size and modification time, and the transformers version), and read back on the
next start: SmolLM2's took 1.5 s to build (importing transformers' model code for the converter, then
converting), 0.95 s to read back (Zen 3; importing transformers itself is most of both), all of it
Python under the GIL, which the weights' loading on the other thread waits for on two cores.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

from tokenmill import envs

from .errors import ModelLoadError

logger = logging.getLogger(__name__)

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
    """(tokenizer, chat_template) from a GGUF file's `tokenizer.*` metadata: converted by transformers,
    or read back from the tokenizer cache."""
    import transformers
    from transformers import PreTrainedTokenizerFast

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
    cached = _cache_files(path, transformers.__version__)
    tok = _read_cached(cached, init_kwargs) if cached is not None else None
    if tok is None:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

        arch = metadata.get("general.architecture", "")
        try:
            backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
            tok = PreTrainedTokenizerFast(tokenizer_object=backend, **init_kwargs, **extra)
        except Exception as e:
            raise ModelLoadError(
                f"{path}: cannot build a tokenizer from the GGUF metadata "
                f"(tokenizer.ggml.model={tokenizer_dict.get('tokenizer_type')!r}): {type(e).__name__}: {e}"
            ) from None
        if cached is not None:
            _write_cached(cached, tok, extra)
    chat_template = metadata.get("tokenizer.chat_template")
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok, chat_template


def _cache_files(path: str, transformers_version: str) -> tuple[str, str] | None:
    """(the tokenizer's file, its extra keyword arguments' file) in the cache for the GGUF file at
    `path` as it is now; None where the cache is off or the file cannot be stat'ed."""
    root = envs.TOKENMILL_TOKENIZER_CACHE_DIR
    if not root:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    what = f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers_version}"
    key = hashlib.sha256(what.encode()).hexdigest()[:32]
    return os.path.join(root, f"{key}.json"), os.path.join(root, f"{key}.kwargs.json")


def _read_cached(files: tuple[str, str], init_kwargs: dict[str, Any]):
    """The cached tokenizer, or None (not cached, or unreadable: it is converted again)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer_file, kwargs_file = files
    if not os.path.isfile(tokenizer_file):
        return None
    try:
        with open(kwargs_file) as f:
            extra = json.load(f)
        return PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, **init_kwargs, **extra)
    except Exception as e:  # noqa: BLE001 - a damaged entry is rebuilt, not fatal
        logger.warning("cached tokenizer %s unreadable (%s: %s); converting the GGUF's again",
                       tokenizer_file, type(e).__name__, e)
        return None


def _write_cached(files: tuple[str, str], tok, extra: dict[str, Any]) -> None:
    """Keep `tok` (and the converter's `extra` arguments) for the next start; each file is written
    whole under another name, then renamed, the tokenizer last: readers look for it first."""
    tokenizer_file, kwargs_file = files
    try:
        os.makedirs(os.path.dirname(tokenizer_file), exist_ok=True)
        partial = f"{kwargs_file}.{os.getpid()}.partial"
        with open(partial, "w") as f:
            json.dump(extra, f)
        os.replace(partial, kwargs_file)
        partial = f"{tokenizer_file}.{os.getpid()}.partial"
        tok.backend_tokenizer.save(partial)
        os.replace(partial, tokenizer_file)
    except (OSError, TypeError, ValueError) as e:  # a read-only cache, or arguments JSON cannot hold
        logger.warning("could not keep the tokenizer in %s (%s: %s)", os.path.dirname(tokenizer_file),
                       type(e).__name__, e)
