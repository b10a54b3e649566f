"""2 MiB pages for the weights and the KV cache on CPU (worker/huge_pages.py), read back from /proc/self/smaps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from tests.smaps import mapping_of, needs_thp, whole_pages
from tokenmill.ops.cpu.lazy_zeros import zeros
from tokenmill.worker.huge_pages import HUGE_PAGE, ask_for_huge_pages, move_to_huge_pages

pytestmark = needs_thp


def test_weights_move_onto_huge_pages_with_their_values():
    values = np.random.default_rng(0).standard_normal((4096, 1024), dtype=np.float32)  # 16 MiB
    weights = {"w": jnp.asarray(values), "small": jnp.ones(16)}
    first, length = whole_pages(weights["w"])
    assert length >= weights["w"].nbytes - 2 * HUGE_PAGE
    assert move_to_huge_pages(weights, "test weights") == length  # the small one has no whole huge page
    mapping = mapping_of(first)
    assert "hg" in mapping["VmFlags"]
    assert mapping["AnonHugePages"] >= length, mapping
    np.testing.assert_array_equal(np.asarray(weights["w"]), values)


def test_the_lazy_kv_cache_asks_for_huge_pages():
    sharding = SingleDeviceSharding(jax.devices("cpu")[0])
    cache = zeros((4, 2048, 1024), jnp.float32, sharding)  # 32 MiB, no page touched yet
    assert ask_for_huge_pages([cache]) >= cache.nbytes - 2 * HUGE_PAGE
    first, _ = whole_pages(cache)
    assert "hg" in mapping_of(first)["VmFlags"]
    write = jax.jit(lambda c, i: c.at[i].set(2.0), donate_argnums=0)
    # (whether the pages written come as 2 MiB ones is the kernel's call: where it finds no free 2 MiB
    # of memory at that moment, it gives 4 KiB pages)
    cache = write(cache, 2)
    assert whole_pages(cache)[0] == first, "the donated cache moved"
    assert "hg" in mapping_of(first)["VmFlags"]
    host = np.asarray(cache)
    assert (host[2] == 2.0).all() and not host[[0, 1, 3]].any()


def test_off_switch(monkeypatch):
    monkeypatch.setenv("TOKENMILL_HUGE_PAGES", "0")
    array = jnp.zeros((1024, 1024))
    assert move_to_huge_pages([array], "test weights") == 0
    assert ask_for_huge_pages([array]) == 0
