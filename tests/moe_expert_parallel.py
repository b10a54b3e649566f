"""Run by tests/test_moe.py in its own process, with XLA_FLAGS=--xla_force_host_platform_device_count=8
set before JAX starts: expert-parallel fused_moe on meshes (1, n), n = 1, 2, 4, 8, equals the
single-device result; so do int8 experts on 8 devices and the reference path
(TOKENMILL_USE_MOE_EP_KERNEL=0); 12 experts over 8 devices are refused. Prints "expert parallel OK"
when every check passes."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(__file__))
from test_moe import F32_REL, WSZ, assert_close, make_moe, quantized  # noqa: E402

from tokenmill.ops.moe import fused_moe  # noqa: E402

EXPERT_SHARDED = ("w1", "w2", "b1", "b2", "w1_scale", "w2_scale")


def on_mesh(arrays: dict, mesh: Mesh) -> dict:
    """The experts' arrays sharded over "model" (as the model's params are), the rest replicated."""
    return {
        k: jax.device_put(v, NamedSharding(mesh, P("model") if k in EXPERT_SHARDED else P()))
        for k, v in arrays.items()
    }


def fused(arrays: dict, mesh: Mesh | None, **options) -> np.ndarray:
    call = jax.jit(lambda a: fused_moe(**a, top_k=4, renormalize_topk_logits=True, mesh=mesh, **options))
    return np.asarray(call(arrays))


def mesh_of(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]).reshape(1, n), ("data", "model"))


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    arrays, options = make_moe(10, T=7, E=16, biases=True), dict(act_fn="swigluoai")
    single = fused(arrays, None, **options)
    for n in (1, 2, 4, 8):
        assert_close(fused(on_mesh(arrays, mesh_of(n)), mesh_of(n), **options), single, F32_REL)
        print(f"mesh (1, {n}) matches", flush=True)

    int8, int8_options = quantized(make_moe(11, T=7, E=32), jnp.int8), dict(act_fn="silu", subc_quant_wsz=WSZ)
    int8_single = fused(int8, None, **int8_options)
    assert_close(fused(on_mesh(int8, mesh_of(8)), mesh_of(8), **int8_options), int8_single, F32_REL)
    print("int8 experts: mesh (1, 8) matches", flush=True)

    os.environ["TOKENMILL_USE_MOE_EP_KERNEL"] = "0"
    assert_close(fused(on_mesh(arrays, mesh_of(4)), mesh_of(4), **options), single, F32_REL)
    del os.environ["TOKENMILL_USE_MOE_EP_KERNEL"]
    print("reference path: mesh (1, 4) matches", flush=True)

    try:
        fused(make_moe(12, T=3, E=12), mesh_of(8), act_fn="silu")
    except ValueError as e:
        assert "(12)" in str(e) and "(8)" in str(e), e
    else:
        raise AssertionError("12 experts over a model axis of 8 was not refused")
    print("expert parallel OK")


if __name__ == "__main__":
    main()
