"""What /proc/self/smaps says of a buffer's pages: for the tests of 2 MiB pages (worker/huge_pages.py)."""

from __future__ import annotations

import sys

import jax
import pytest

from tokenmill.worker import huge_pages


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


needs_thp = pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() == "never",
                               reason="transparent huge pages: Linux with THP not 'never'")


def mapping_of(address: int) -> dict:
    """The /proc/self/smaps entry of the mapping holding `address`: start, end, AnonHugePages (bytes), VmFlags."""
    entry = None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                if entry is not None and entry["start"] <= address < entry["end"]:
                    return entry
                start, end = (int(x, 16) for x in fields[0].split("-"))
                entry = {"start": start, "end": end, "AnonHugePages": 0, "VmFlags": []}
            elif fields[0] == "AnonHugePages:":
                entry["AnonHugePages"] = int(fields[1]) * 1024
            elif fields[0] == "VmFlags:":
                entry["VmFlags"] = fields[1:]
    assert entry is not None and entry["start"] <= address < entry["end"], hex(address)
    return entry


def whole_pages(array: jax.Array) -> tuple[int, int]:
    """The 2 MiB-aligned part of `array`'s buffer: (first address, length)."""
    return huge_pages.whole_huge_pages(array.unsafe_buffer_pointer(), array.nbytes)
