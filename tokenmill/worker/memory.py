"""Free device memory, measured, for sizing the KV cache."""

from __future__ import annotations

import jax


def free_device_memory() -> int:
    """Bytes free on this process's first device: allocator stats on GPU/TPU, MemAvailable on CPU.
    (In a multi-host job jax.devices()[0] may be another host's.)"""
    device = jax.local_devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot measure free memory: no allocator stats and no /proc/meminfo")
