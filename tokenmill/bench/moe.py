"""`tokenmill bench moe`: the fused MoE op against its reference and against plain dense matmuls.

One MoE layer at Qwen3-30B-A3B's shapes by default (hidden 2048, expert intermediate 768, 128
experts, top-8, 512 tokens), random seeded weights and gating. Three timings: `fused_moe`,
`ref_moe`, and "dense": one [T*k, D] x [D, 2F] and one [T*k, F] x [F, D] matmul, i.e. the rows the
routing produced multiplied as if they all went to one expert, the floor the fused op aims at.
`fused_moe` gets the experts in the layout a model stores them in on this machine (`ops.moe.
kernel_layout`, made at load time: the CPU kernel's strips for float32 experts), `ref_moe` as they
are.
"""

from __future__ import annotations

import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from tokenmill.distributed.mesh import make_mesh
from tokenmill.ops.moe import fused_moe, kernel_layout, ref_moe, route
from tokenmill.ops.quantization import quantize_windows

QUANT_DTYPES = {"int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
SEED = 0


def _timings(fn, args, reps: int) -> list[float]:
    """Seconds per call over `reps` calls, after one warm-up call (which also compiles)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def _inputs(args, dtype) -> dict:
    T, D, F, E = args.num_tokens, args.hidden, args.intermediate, args.experts
    k_tokens, k_w1, k_w2, k_gate = jax.random.split(jax.random.key(SEED), 4)
    normal = jax.jit(jax.random.normal, static_argnums=(1, 2))
    return dict(
        tokens=normal(k_tokens, (T, D), dtype),
        # scaled so that gate/up and the output stay around unit size
        w1=normal(k_w1, (E, 2, D, F), dtype) * jnp.asarray(D**-0.5, dtype),
        w2=normal(k_w2, (E, F, D), dtype) * jnp.asarray(F**-0.5, dtype),
        gating_output=normal(k_gate, (T, E), jnp.float32),
    )


def run(args) -> dict:
    dtype = jnp.dtype(args.dtype)
    T, D, F, E, k = args.num_tokens, args.hidden, args.intermediate, args.experts, args.top_k
    arrays = _inputs(args, dtype)
    options = dict(top_k=k, renormalize_topk_logits=True, act_fn="silu")
    if args.quant != "none":
        quantize = jax.jit(quantize_windows, static_argnums=(1, 2, 3))
        arrays["w1"], arrays["w1_scale"] = quantize(arrays["w1"], QUANT_DTYPES[args.quant], args.wsz, 2)
        arrays["w2"], arrays["w2_scale"] = quantize(arrays["w2"], QUANT_DTYPES[args.quant], args.wsz, 1)
        options["subc_quant_wsz"] = args.wsz

    stored = dict(arrays)  # as a model on this machine stores its experts
    stored["w1"], stored["w2"] = kernel_layout(arrays["w1"], arrays["w2"], make_mesh(1))
    fused = jax.jit(lambda a: fused_moe(**a, **options))
    ref = jax.jit(lambda a: ref_moe(**a, **options))
    fused_times = _timings(fused, (stored,), args.reps)
    ref_times = _timings(ref, (arrays,), args.reps)
    fused_out, ref_out = np.asarray(fused(stored), np.float32), np.asarray(ref(arrays), np.float32)
    max_rel_diff = float(np.max(np.abs(fused_out - ref_out)) / np.max(np.abs(ref_out)))

    _, ids = route(arrays["gating_output"], k, True)
    group_sizes = np.bincount(np.asarray(ids).reshape(-1), minlength=E)
    rows = int(group_sizes.sum())  # T * k: every routed (token, expert) pair is one row
    dense_x = jnp.ones((rows, D), dtype)
    dense_h = jnp.ones((rows, F), dtype)
    dense_w1, dense_w2 = jnp.ones((D, 2 * F), dtype), jnp.ones((F, D), dtype)
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32)
    dense = jax.jit(lambda x, h, w1, w2: (dot(x, w1), dot(h, w2)))
    dense_times = _timings(dense, (dense_x, dense_h, dense_w1, dense_w2), args.reps)

    flops = 2 * rows * D * 2 * F + 2 * rows * F * D
    result = {
        "bench": "moe",
        "num_tokens": T, "hidden": D, "intermediate": F, "experts": E, "top_k": k,
        "dtype": args.dtype, "quant": args.quant, "wsz": args.wsz if args.quant != "none" else None,
        "experts_layout": "strips" if stored["w1"].ndim == 5 else "row-major",
        "experts_used": int((group_sizes > 0).sum()),
        "group_size_min": int(group_sizes.min()), "group_size_max": int(group_sizes.max()),
        "flops": flops,
        "fused_vs_ref_max_rel_diff": max_rel_diff,
    }
    for name, times in (("fused", fused_times), ("ref", ref_times), ("dense", dense_times)):
        result.update({
            f"{name}_ms_median": 1e3 * statistics.median(times),
            f"{name}_ms_min": 1e3 * min(times),
            f"{name}_ms_max": 1e3 * max(times),
            f"{name}_gflops": flops / statistics.median(times) / 1e9,
        })
    result["ref_over_fused"] = result["ref_ms_median"] / result["fused_ms_median"]
    result["fused_over_dense"] = result["fused_ms_median"] / result["dense_ms_median"]

    quant = "" if args.quant == "none" else f", {args.quant} experts (window {args.wsz})"
    print(f"MoE layer: {T} tokens, hidden {D}, intermediate {F}, {E} experts, top-{k}, {args.dtype}{quant}; "
          f"experts {result['experts_layout']}; {result['experts_used']} experts used, "
          f"groups of {result['group_size_min']}..{result['group_size_max']} rows")
    print(f"{'':18}{'median ms':>11}{'min ms':>9}{'max ms':>9}{'GFLOP/s':>9}   ({flops / 1e9:.1f} GFLOP routed)")
    for name, label in (("fused", "fused_moe"), ("ref", "ref_moe"), ("dense", "dense matmuls")):
        print(f"{label:18}{result[f'{name}_ms_median']:>11.1f}{result[f'{name}_ms_min']:>9.1f}"
              f"{result[f'{name}_ms_max']:>9.1f}{result[f'{name}_gflops']:>9.1f}")
    print(f"fused is {result['ref_over_fused']:.1f}x faster than ref_moe and takes "
          f"{result['fused_over_dense']:.2f}x the dense time; fused vs ref max diff {max_rel_diff:.2g} (relative)")
    print("RESULT " + json.dumps(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
