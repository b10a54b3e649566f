"""The weights and the KV cache on 2 MiB pages (Linux, CPU): a decode step streams them faster.

A decode step reads every weight once, hundreds of MB a token, and on 4 KiB pages that stream
crosses a page every 4 KiB: a TLB miss each time, and the hardware prefetchers, which do not follow
a stream across a page, start over. XLA allocates its buffers without asking for transparent huge
pages, and with THP in its usual "madvise" mode Linux gives them only to memory that asks. So the
model runner, once its buckets have compiled (on the precompiling thread, while the engine already
serves), marks each weight buffer's whole 2 MiB pages MADV_HUGEPAGE and collapses them at once with
MADV_COLLAPSE (Linux 6.1; before it, khugepaged collapses marked memory in its own time): SmolLM2's
540 MB take about a second. Not sooner: on two cores it slowed the first token. The KV cache, whose
pages are not there until first written (ops/cpu/lazy_zeros.cc), is only marked: its pages come as
2 MiB ones when written, where the kernel has 2 MiB free at that moment.

Measured on a 2 vCPU AMD EPYC Zen 4: a plain two-thread read of 256 MiB ran at 31-32 GB/s on huge
pages against 28-29 on 4 KiB ones, and SmolLM2's float32 single-stream decode went from 53.6 to
58.9 tok/s (medians of 6 runs each, alternating processes).
"""

from __future__ import annotations

import ctypes
import logging
import sys
import time

import jax

from tokenmill import envs

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25  # Linux 6.1; older kernels answer EINVAL and khugepaged collapses in its own time


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return libc
    except (OSError, AttributeError):
        return None


def whole_huge_pages(start: int, nbytes: int) -> tuple[int, int]:
    """The 2 MiB-aligned part of [start, start + nbytes): (first address, length), length 0 if none."""
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = (start + nbytes) // HUGE_PAGE * HUGE_PAGE
    return first, max(0, last - first)


def cpu_buffers(arrays) -> list[jax.Array]:
    """The single-device buffers on CPU of `arrays` (a pytree), each at least one huge page long."""
    buffers = []
    for array in jax.tree.leaves(arrays):
        if not isinstance(array, jax.Array):
            continue
        for shard in array.addressable_shards:
            if shard.device.platform == "cpu" and shard.data.nbytes >= HUGE_PAGE:
                buffers.append(shard.data)
    return buffers


def advise(buffers, collapse: bool = True) -> tuple[int, int | None]:
    """Mark each buffer's whole 2 MiB pages MADV_HUGEPAGE, and collapse them now (`collapse`).
    Returns (bytes advised, errno of the first collapse that failed, else None). The buffers must
    stay alive meanwhile (the caller holds them)."""
    libc = _libc()
    if libc is None:
        return 0, None
    advised, collapse_errno = 0, None
    for buf in buffers:
        first, length = whole_huge_pages(buf.unsafe_buffer_pointer(), buf.nbytes)
        if length == 0 or libc.madvise(first, length, MADV_HUGEPAGE) != 0:
            continue
        advised += length
        if collapse and collapse_errno is None and libc.madvise(first, length, MADV_COLLAPSE) != 0:
            collapse_errno = ctypes.get_errno()
    return advised, collapse_errno


def ask_for_huge_pages(arrays) -> int:
    """Mark `arrays`' CPU buffers MADV_HUGEPAGE without collapsing them: the pages not yet written
    (the lazily zeroed KV cache's) come as 2 MiB pages when first written. Returns the bytes marked."""
    if not envs.TOKENMILL_HUGE_PAGES:
        return 0
    return advise(cpu_buffers(arrays), collapse=False)[0]


def move_to_huge_pages(arrays, what: str) -> int:
    """Move `arrays`' CPU buffers onto 2 MiB pages now (logged, as `what`); returns the bytes marked
    (0: TOKENMILL_HUGE_PAGES=0, not Linux, or no CPU buffer of a huge page or more)."""
    if not envs.TOKENMILL_HUGE_PAGES:
        return 0
    buffers = cpu_buffers(arrays)
    if not buffers:
        return 0
    start = time.perf_counter()
    advised, collapse_errno = advise(buffers)
    total = sum(b.nbytes for b in buffers)
    if collapse_errno is None:
        logger.info("%s on 2 MiB pages: %.0f of %.0f MiB in %.1f s", what, advised / 2**20, total / 2**20,
                    time.perf_counter() - start)
    else:
        logger.info("%s: %.0f of %.0f MiB marked for 2 MiB pages; collapsing them now failed (errno %d), "
                    "khugepaged will in its own time", what, advised / 2**20, total / 2**20, collapse_errno)
    return advised
