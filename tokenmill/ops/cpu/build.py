"""Compile the package's C++ CPU kernels on first use, cache the shared library, register FFI targets.

The library is built with the system C++ compiler (`$CXX`, else g++, else c++) against the XLA FFI
headers that ship with jaxlib, into `~/.cache/tokenmill/kernels/<name>-<hash>.so` (a temporary
directory if that is read-only), where the hash covers the source and the headers beside it, the
compiler and its flags, the jaxlib version and the machine. Concurrent
processes serialise on a file lock and publish the library with an atomic rename, so a half-written
library is never loaded. The x86 build uses -mavx2 -mfma only when the CPU reports both (checked at
run time), adding -mavx512f where it reports that too (and the AVX512-VNNI, AVX512-BF16 and AMX-BF16
flags where it reports those), else it is a portable -O3 build.

Nothing here raises: when the compiler is missing or the build fails, `load()` logs one warning and
returns None, and callers fall back to the jnp reference. `build_error()` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import jax
import jaxlib

logger = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).resolve().parent
_BASE_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-ffp-contract=fast", "-fno-math-errno", "-Wno-psabi")
_BUILD_TIMEOUT_S = 300


@dataclass(frozen=True)
class Kernel:
    """One FFI target: its name in XLA, the exported handler symbol and the source file."""

    target: str
    symbol: str
    source: str


PAGED_ATTENTION = Kernel("tokenmill_paged_attention", "TokenmillPagedAttention", "paged_attention.cc")
MOE_EXPERTS = Kernel("tokenmill_moe_experts", "TokenmillMoeExperts", "moe_experts.cc")
LINEAR = Kernel("tokenmill_linear", "TokenmillLinear", "linear.cc")
LAZY_ZEROS = Kernel("tokenmill_lazy_zeros", "TokenmillLazyZeros", "lazy_zeros.cc")
ARGMAX = Kernel("tokenmill_argmax", "TokenmillArgmax", "argmax.cc")
GREEDY_HEAD = Kernel("tokenmill_greedy_head", "TokenmillGreedyHead", "greedy_head.cc")
SCREEN_HEAD = Kernel("tokenmill_screen_head", "TokenmillScreenHead", "screen_head.cc")

_lock = threading.Lock()
_loaded: dict[str, bool] = {}
_errors: dict[str, str] = {}


def _cpu_flags() -> set[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# the bfloat16 dot products of --quantization w8a16: AVX512-BF16 (bf16_pack.h, avx512_bf16.h), and
# on top of it AMX's bfloat16 tiles (amx_bf16.h)
_BF16_FLAGS = {"avx512_bf16": "-mavx512bf16", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl"}
_AMX_FLAGS = {"amx_tile": "-mamx-tile", "amx_bf16": "-mamx-bf16"}
# the integer dot products of --quantization w8a16_int (int8_dot.h): AVX512-VNNI's VPDPBUSD
_VNNI_FLAGS = {"avx512_vnni": "-mavx512vnni", "avx512bw": "-mavx512bw"}


def isa_flags() -> tuple[str, ...]:
    """The widest vector ISA this CPU runs: AVX-512F, else AVX2 + FMA, else none (portable); plus
    AVX512-VNNI, AVX512-BF16, and AMX-BF16, where the CPU has them."""
    cpu = _cpu_flags()
    if not {"avx2", "fma"} <= cpu:
        return ()
    flags = ("-mavx2", "-mfma") + (("-mavx512f",) if "avx512f" in cpu else ())
    if "avx512f" in cpu and set(_VNNI_FLAGS) <= cpu:
        flags += tuple(_VNNI_FLAGS.values())
    if "avx512f" in cpu and set(_BF16_FLAGS) <= cpu:
        flags += tuple(_BF16_FLAGS.values())
        if set(_AMX_FLAGS) <= cpu:
            flags += tuple(_AMX_FLAGS.values())
    return tuple(dict.fromkeys(flags))  # each once (VNNI and BF16 both need AVX512-BW)


def find_compiler() -> str | None:
    for candidate in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def cache_dir() -> Path:
    """~/.cache/tokenmill/kernels, or a per-user temporary directory where that is not writable."""
    preferred = Path(os.path.expanduser("~")) / ".cache" / "tokenmill" / "kernels"
    try:
        preferred.mkdir(parents=True, exist_ok=True)
        if os.access(preferred, os.W_OK):
            return preferred
    except OSError:
        pass
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"tokenmill-kernels-{uid}"


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def library_path(kernel: Kernel, cxx: str, flags: tuple[str, ...]) -> Path:
    h = hashlib.sha256()
    headers = [path.read_bytes() for path in sorted(_SOURCE_DIR.glob("*.h"))]  # what the sources include
    for part in (
        (_SOURCE_DIR / kernel.source).read_bytes(),
        *headers,
        _compiler_version(cxx).encode(),
        " ".join(flags).encode(),
        jaxlib.__version__.encode(),
        platform.machine().encode(),
        sys.platform.encode(),
    ):
        h.update(part)
        h.update(b"\0")
    return cache_dir() / f"{Path(kernel.source).stem}-{h.hexdigest()[:16]}.so"


def _compile(kernel: Kernel, cxx: str, flags: tuple[str, ...], out: Path) -> None:
    """Build into a temporary file next to `out`, then rename it into place (atomic)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp.so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *flags, "-isystem", jax.ffi.include_dir(), str(_SOURCE_DIR / kernel.source), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build_locked(kernel: Kernel, cxx: str, flags: tuple[str, ...], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no POSIX locks: the atomic rename alone keeps readers safe
        fcntl = None
    with open(out.with_suffix(".lock"), "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not out.exists():  # another process may have built it while we waited
                logger.info("compiling %s (%s)", kernel.source, " ".join(flags))
                _compile(kernel, cxx, flags, out)
        finally:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_UN)


def build(kernel: Kernel) -> Path:
    """The path of the kernel's shared library, compiling it if it is not cached. Raises on failure."""
    cxx = find_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    flags = _BASE_FLAGS + isa_flags()
    out = library_path(kernel, cxx, flags)
    if not out.exists():
        _build_locked(kernel, cxx, flags, out)
    return out


def load(kernel: Kernel = PAGED_ATTENTION) -> bool:
    """Build (or find) the library and register its FFI target for the CPU platform, once per process.

    Returns whether the target is usable; failures are logged once and remembered."""
    with _lock:
        if kernel.target in _loaded:
            return _loaded[kernel.target]
        try:
            lib = ctypes.CDLL(str(build(kernel)))
            handler = getattr(lib, kernel.symbol)
            jax.ffi.register_ffi_target(kernel.target, jax.ffi.pycapsule(handler), platform="cpu")
            _loaded[kernel.target] = True
        except Exception as e:  # noqa: BLE001 - any failure means: use the reference
            _errors[kernel.target] = f"{type(e).__name__}: {e}"
            _loaded[kernel.target] = False
            logger.warning(
                "CPU kernel %s unavailable, using the jnp reference instead: %s", kernel.target, _errors[kernel.target]
            )
        return _loaded[kernel.target]


def build_error(kernel: Kernel = PAGED_ATTENTION) -> str | None:
    return _errors.get(kernel.target)


KERNELS = (PAGED_ATTENTION, MOE_EXPERTS, LINEAR, LAZY_ZEROS, ARGMAX, GREEDY_HEAD, SCREEN_HEAD)


def _build_one(kernel: Kernel) -> str:
    try:
        return str(build(kernel))
    except Exception as e:  # noqa: BLE001 - reported; the engine falls back to the jnp reference
        return f"unavailable ({type(e).__name__}: {e})"


def build_all() -> None:
    """Build every kernel that is not cached yet, side by side (`python -m tokenmill.ops.cpu`). `make
    run` does this before serving, so that a first start does not wait for the compiler (~7 s of g++
    on two cores)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(KERNELS)) as pool:
        for kernel, where in zip(KERNELS, pool.map(_build_one, KERNELS)):
            print(f"{kernel.source}: {where}")
