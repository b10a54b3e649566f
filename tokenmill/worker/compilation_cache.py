"""JAX's persistent compilation cache, on by default, so a second start-up skips compiling."""

from __future__ import annotations

import logging
import os

import jax

from tokenmill import envs

logger = logging.getLogger(__name__)
_enabled = False


def enable_compilation_cache() -> None:
    global _enabled
    path = envs.TOKENMILL_COMPILATION_CACHE_DIR
    if _enabled or not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _enabled = True
    logger.info("persistent compilation cache: %s", path)
