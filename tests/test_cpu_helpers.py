"""The spinning helper threads of parallel.h are one set per process, shared by all kernel libraries.

Each kernel is its own shared library; with a set of helpers each, a decode step had one idle
helper spinning against the other's work on every core (SmolLM2's W2 8-bit, 3 alternating rounds:
131-133 tok/s with a set each, 135-150 shared). Run in a fresh process so that no earlier test has
started the helpers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


_SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ["TOKENMILL_LINEAR_BACKEND"] = "cpu_kernel"
    import jax, jax.numpy as jnp, numpy as np
    sys.path.insert(0, {tests!r})
    from test_attention_kernel import make_batch
    from tokenmill.ops import cpu
    from tokenmill.ops.cpu import linear as cpu_linear
    from tokenmill.ops.linear import linear

    assert cpu.available() and cpu_linear.available()
    threads = lambda: len(os.listdir("/proc/self/task"))

    # a decode GEMV big enough for helpers (3.4 MiB of weights), compiled before counting
    w = jnp.ones((1, 576, 1536), jnp.float32)
    x = jnp.ones((1, 576), jnp.float32)
    gemv = jax.jit(lambda x, w: linear(x, w, 0)).lower(x, w).compile()
    start = threads()
    gemv(x, w).block_until_ready()
    after_gemv = threads()

    # a decode step's attention (one token over 200 cached, 3 kv heads): short calls, spinning helpers
    q, kc, vc, md = make_batch(np.random.default_rng(0), [(200, 1)], kv_heads=3, group=3, head_dim=64)
    attn = jax.jit(lambda q, kc, vc, md: cpu.paged_attention(q, kc, vc, jnp.int32(1), md, scale=0.125))
    attn = attn.lower(q, kc, vc, md).compile()
    before_attention = threads()
    for _ in range(3):
        attn(q, kc, vc, md).block_until_ready()
    print("THREADS", start, after_gemv, before_attention, threads())
    """
)


def test_kernel_libraries_share_one_set_of_helpers():
    script = _SCRIPT.format(tests=str(Path(__file__).resolve().parent))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("THREADS"))
    start, after_gemv, before_attention, end = map(int, line.split()[1:])
    if (os.cpu_count() or 1) > 1:  # (one core: XLA's pool has one thread, and no kernel starts helpers)
        assert after_gemv > start  # the linear kernel started its helpers
    assert end == before_attention  # the attention kernel found them running: no threads of its own
