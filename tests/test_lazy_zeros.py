"""The KV cache's lazily mapped zeros (ops/cpu/lazy_zeros.cc): zeros, whatever the buffer held before."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from tokenmill.ops.cpu import build
from tokenmill.ops.cpu.lazy_zeros import zeros


@pytest.mark.parametrize("shape, dtype", [((3, 1000, 7), jnp.float32), ((2, 4096, 5), jnp.bfloat16), ((13,), jnp.float32)])
def test_zeros_even_in_a_reused_buffer(shape, dtype):
    assert build.load(build.LAZY_ZEROS), build.build_error(build.LAZY_ZEROS)
    sharding = SingleDeviceSharding(jax.devices("cpu")[0])
    for _ in range(3):  # freed buffers of this size held ones: the allocator may hand one back
        ones = jax.jit(lambda: jnp.ones(shape, dtype))()
        ones.block_until_ready()
        del ones
        z = zeros(shape, dtype, sharding)
        assert z.shape == shape and z.dtype == dtype and z.sharding == sharding
        assert not np.asarray(z.astype(jnp.float32)).any()


def test_written_after_donation_reads_back():
    sharding = SingleDeviceSharding(jax.devices("cpu")[0])
    cache = zeros((4, 1024, 16), jnp.float32, sharding)
    write = jax.jit(lambda c, i: c.at[i].set(2.0), donate_argnums=0)
    cache = write(cache, 2)
    host = np.asarray(cache)
    assert (host[2] == 2.0).all() and not host[[0, 1, 3]].any()
