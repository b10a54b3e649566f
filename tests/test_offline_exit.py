"""A script that ends while the offline engine still compiles its shape buckets in the background
exits cleanly: the precompiling thread is stopped at exit instead of being unwound inside XLA, which
aborted the process (exit status 134) about half the time."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import sys
from tokenmill import LLM
llm = LLM(sys.argv[1], max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512, num_blocks=300)
print("precompiling:", llm.engine.runner.precompiling())
"""


def test_exit_while_precompiling_is_clean(smollm2_path):
    env = {**os.environ, "TOKENMILL_SKIP_PRECOMPILE": "0"}
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", SCRIPT, smollm2_path], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "precompiling: True" in out.stdout
