"""Which accelerators each data-parallel rank owns.

Rank r of N takes devices [r * T, (r + 1) * T) of the front end's visible list (T =
tensor_parallel_size), handed to its process as CUDA_VISIBLE_DEVICES before JAX starts there, so
that its mesh (jax.devices()) is exactly its slice. The list is the front end's own
CUDA_VISIBLE_DEVICES, or 0..N*T-1 when that is unset.

On CPU every process has its own host device(s) anyway: CUDA_VISIBLE_DEVICES is then inert, and an
empty CUDA_VISIBLE_DEVICES (GPUs hidden on purpose) stays empty. TPU chips are not sliced here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from tokenmill.config import ParallelConfig

DEVICE_ENV = "CUDA_VISIBLE_DEVICES"


def rank_visible_devices(rank: int, parallel: ParallelConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    """The value of DEVICE_ENV for `rank`'s process, or None to leave its environment alone."""
    num_ranks, per_rank = parallel.data_parallel_size, parallel.tensor_parallel_size
    if num_ranks == 1:
        return None
    raw = environ.get(DEVICE_ENV)
    if raw is not None and not raw.strip():
        return raw
    visible = [d.strip() for d in raw.split(",")] if raw is not None else [str(i) for i in range(num_ranks * per_rank)]
    if len(visible) < num_ranks * per_rank:
        raise ValueError(
            f"data_parallel_size={num_ranks} x tensor_parallel_size={per_rank} needs {num_ranks * per_rank} "
            f"devices, but {DEVICE_ENV}={raw} lists {len(visible)}"
        )
    return ",".join(visible[rank * per_rank:(rank + 1) * per_rank])
