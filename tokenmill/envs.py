"""Every TOKENMILL_* environment variable, in one place: type, default, allowed values.

Read lazily (`envs.TOKENMILL_SKIP_PRECOMPILE`), validated with an error that names the variable
and what it accepts; `freeze()` caches the values once the engine has started.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class _Var:
    parse: Callable[[str], Any]
    default: Any
    doc: str
    choices: tuple[str, ...] | None = None


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected one of 1/0/true/false/yes/no/on/off")


_DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")

VARIABLES: dict[str, _Var] = {
    "TOKENMILL_SKIP_PRECOMPILE": _Var(_bool, False, "skip compiling every shape bucket in the background"),
    "TOKENMILL_CHECK_RECOMPILATION": _Var(_bool, False, "raise if anything compiles after warm-up"),
    "TOKENMILL_COMPILATION_CACHE_DIR": _Var(
        str, os.path.join(_DEFAULT_CACHE, "xla"), "JAX persistent compilation cache directory ('' disables it)"
    ),
    "TOKENMILL_TOKENIZER_CACHE_DIR": _Var(
        str, os.path.join(_DEFAULT_CACHE, "tokenizers"),
        "GGUF tokenizers as transformers converts them, kept per file and read back on the next start "
        "instead of converted again ('' disables it)",
    ),
    "TOKENMILL_ATTENTION_BACKEND": _Var(
        str.lower,
        "auto",
        "paged attention: auto (the C++ kernel on CPU when it builds, else the jnp reference), "
        "reference (always the jnp reference), cpu_kernel (always the C++ kernel; error if it cannot build)",
        choices=("auto", "reference", "cpu_kernel"),
    ),
    "TOKENMILL_LINEAR_BACKEND": _Var(
        str.lower,
        "auto",
        "Llama-family projections (float32 or --quantization): auto (the C++ kernel on CPU when it builds, else "
        "jnp), jnp (dequantize, then XLA's dot), cpu_kernel (always the C++ kernel; error if it cannot build)",
        choices=("auto", "jnp", "cpu_kernel"),
    ),
    "TOKENMILL_CPU_BF16_DOT": _Var(
        _bool,
        True,
        "--quantization w8a16 on CPU: multiply with the CPU's bfloat16 dot products where it has them, AMX "
        "tiles or else AVX512-BF16 (off: the float32 FMA path, same rounding of the inputs)",
    ),
    "TOKENMILL_GREEDY_HEAD": _Var(
        _bool,
        True,
        "float32 LM head on CPU: a greedy step with no logprobs screens its rows (up to 4) through an int8 copy of the head "
        "and computes only the float32 logits that could be the largest (the same argmax; +28 MB for SmolLM2)",
    ),
    "TOKENMILL_HUGE_PAGES": _Var(
        _bool,
        True,
        "CPU on Linux: move the weights onto 2 MiB pages once the buckets have compiled (MADV_HUGEPAGE + MADV_COLLAPSE) "
        "and ask for them for the KV cache; a decode step streams its weights faster (0: the allocator's pages)",
    ),
    "TOKENMILL_MOE_BACKEND": _Var(
        str.lower,
        "auto",
        "fused MoE expert FFNs: auto (the C++ kernel on CPU for float32 / int8 / fp8 experts when it builds, "
        "else jnp), jnp (always the jnp tiles), cpu_kernel (always the C++ kernel; error if it cannot build)",
        choices=("auto", "jnp", "cpu_kernel"),
    ),
    "TOKENMILL_USE_MOE_EP_KERNEL": _Var(
        _bool,
        True,
        "fused MoE over a mesh: each device computes its own experts' tokens (expert parallel); "
        "0 computes the reference MoE under the shardings the arrays carry",
    ),
    "TOKENMILL_SHUTDOWN_GRACE_S": _Var(
        float, 30.0, "serve: seconds in-flight requests get to finish after SIGTERM before they are aborted"
    ),
    "TOKENMILL_ENGINE_STARTUP_TIMEOUT_S": _Var(
        float, 900.0, "serve: seconds the engine core may take to load the model and start"
    ),
    "TOKENMILL_ENGINE_STALL_TIMEOUT_S": _Var(
        float, 300.0, "serve: an engine core that produces nothing this long with requests in flight is dead"
    ),
    "TOKENMILL_MULTIHOST_BACKEND": _Var(
        str.lower, "", "run the model's workers across hosts: ray (one Ray actor per host); '' keeps them "
        "in-process (the distributed_executor_backend engine argument wins over this)", choices=("", "ray"),
    ),
    "TOKENMILL_RAY_DEVICE_RESOURCE": _Var(
        str, "tokenmill_device", "ray: the Ray resource that counts a host's accelerators (GPU on GPU hosts; "
        "start each node with --resources='{\"tokenmill_device\": N}' otherwise)",
    ),
    "TOKENMILL_RAY_PLACEMENT_TIMEOUT_S": _Var(
        float, 120.0, "ray: seconds to wait for the cluster to grant one bundle of devices per host"
    ),
    "TOKENMILL_RAY_STEP_TIMEOUT_S": _Var(
        float, 600.0, "ray: a worker that takes longer than this over one step (or one call) is hung"
    ),
    "TOKENMILL_LOGGING_LEVEL": _Var(
        str.upper, "INFO", "log level", choices=("DEBUG", "INFO", "WARNING", "ERROR")
    ),
}

_frozen: dict[str, Any] | None = None


def read(name: str) -> Any:
    if _frozen is not None and name in _frozen:
        return _frozen[name]
    var = VARIABLES[name]
    raw = os.environ.get(name)
    if raw is None:
        return var.default
    try:
        value = var.parse(raw)
    except ValueError as e:
        raise ValueError(f"invalid value {raw!r} for {name}: {e}") from None
    if var.choices is not None and value not in var.choices:
        raise ValueError(f"invalid value {raw!r} for {name}; choices: {', '.join(c or repr(c) for c in var.choices)}")
    return value


def freeze() -> None:
    """Cache every variable's value: called once the engine has started."""
    global _frozen
    _frozen = {name: read(name) for name in VARIABLES}


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return read(name)
    raise AttributeError(name)
