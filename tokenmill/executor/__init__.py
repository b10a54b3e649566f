"""Where an engine's model workers live: in the engine's own process (one host), or one Ray actor
per host (ray.py, chosen by distributed_executor_backend="ray" or TOKENMILL_MULTIHOST_BACKEND=ray).

Nothing here imports Ray: it is an optional dependency (`pip install tokenmill[ray]`).
"""

from __future__ import annotations

from tokenmill import envs
from tokenmill.config import ParallelConfig


def distributed_executor_backend(parallel: ParallelConfig) -> str | None:
    """"ray", or None for in-process workers. The engine argument wins over the environment."""
    return parallel.distributed_executor_backend or envs.TOKENMILL_MULTIHOST_BACKEND or None
