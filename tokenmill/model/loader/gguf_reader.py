"""A GGUF file's metadata, tensor table and tensor bytes, read with numpy only.

Why not `gguf.GGUFReader`: it builds a numpy view for every element of every metadata array, which
takes ~5 s for SmolLM2's 49k-token vocabulary and ~20 s for Gemma 3's 262k. Here a string array is
one loop of `struct.unpack_from` over an mmap (a fraction of a second), and tensor data stays
memory-mapped until it is dequantized. Dequantization itself is `gguf.quants.dequantize`.

Format (v2/v3): magic "GGUF", u32 version, u64 tensor count, u64 metadata count, the metadata
key/values, the tensor table (name, dims fastest-first, type, offset), then the data section at the
next `general.alignment` boundary.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from .errors import ModelLoadError

# metadata value types with a fixed width: id -> struct format char
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (ggml lists dimensions fastest first: reversed here)
    qtype: int  # ggml type id
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.qtype).name
        except ValueError:
            return f"unknown ggml type {self.qtype}"


class GGUFFile:
    """An open GGUF file. `metadata` holds every key; string arrays are lists, numeric arrays lists."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            if size < 24:
                raise ModelLoadError(f"{path}: truncated GGUF file ({size} bytes, shorter than the GGUF header)")
            with open(path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ModelLoadError(f"{path}: cannot read the file ({e})") from None
        if self._mm[:4] != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
        version = struct.unpack_from("<I", self._mm, 4)[0]
        if version not in (2, 3):
            raise ModelLoadError(f"{path}: GGUF version {version} is not supported (supported: 2, 3)")
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
            raise ModelLoadError(f"{path}: truncated or corrupt GGUF header ({e})") from None

    # -- parsing -----------------------------------------------------------------------------

    def _parse(self) -> None:
        n_tensors, n_kv = struct.unpack_from("<QQ", self._mm, 8)
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(self._bounded(n_kv, 12)):
            key = self._string()
            (vtype,) = self._unpack("<I", 4)
            self.metadata[key] = self._value(vtype)
        table = []
        for _ in range(self._bounded(n_tensors, 24)):
            name = self._string()
            (n_dims,) = self._unpack("<I", 4)
            dims = self._unpack(f"<{self._bounded(n_dims, 8)}Q", 8 * n_dims)
            qtype, offset = self._unpack("<IQ", 12)
            table.append((name, tuple(int(d) for d in reversed(dims)), qtype, offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (self._pos + align - 1) // align * align
        size = len(self._mm)
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, offset in table:
            info = TensorInfo(name, shape, qtype, data_start + offset, _nbytes(shape, qtype))
            if info.nbytes >= 0 and info.offset + info.nbytes > size:
                raise ModelLoadError(
                    f"{self.path}: truncated GGUF file: tensor {name!r} ends at byte {info.offset + info.nbytes} "
                    f"but the file has {size} bytes"
                )
            self.tensors[name] = info

    def _bounded(self, count: int, min_item_bytes: int) -> int:
        # a corrupt count must fail, not loop for hours: each item takes at least min_item_bytes
        if count * min_item_bytes > len(self._mm) - self._pos:
            raise struct.error(f"count {count} at byte {self._pos} runs past the end of the file")
        return count

    def _unpack(self, fmt: str, width: int) -> tuple:
        out = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += width
        return out

    def _string(self) -> str:
        (n,) = self._unpack("<Q", 8)
        end = self._pos + n
        if end > len(self._mm):
            raise struct.error(f"string of {n} bytes at byte {self._pos} runs past the end of the file")
        s = self._mm[self._pos : end].decode("utf-8")
        self._pos = end
        return s

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALAR:
            fmt = "<" + _SCALAR[vtype]
            return self._unpack(fmt, struct.calcsize(fmt))[0]
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._unpack("<IQ", 12)
            if etype in _SCALAR:
                width = struct.calcsize(_SCALAR[etype])
                arr = np.frombuffer(self._mm, dtype="<" + _SCALAR[etype], count=self._bounded(count, width),
                                    offset=self._pos)
                self._pos += count * width
                return arr.tolist()
            if etype == _STRING:
                return [self._string() for _ in range(self._bounded(count, 8))]
            return [self._value(etype) for _ in range(self._bounded(count, 12))]  # nested arrays
        raise struct.error(f"unknown metadata value type {vtype}")

    # -- tensors -----------------------------------------------------------------------------

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 rows: shape (*shape[:-1], bytes per row), memory-mapped."""
        info = self.tensors[name]
        flat = np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return flat.reshape(*info.shape[:-1], -1) if info.shape else flat

    def dequantize(self, name: str) -> np.ndarray:
        """float32 array in numpy order ([out, in] for a linear weight)."""
        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.qtype)
        raw = self.raw(name)
        out = dequantize_q4_1_q8_0(raw, qtype) if qtype in _WHOLE_TENSOR else dequantize(raw, qtype)
        return out.reshape(info.shape)


_WHOLE_TENSOR = (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)
_BLOCKS_AT_A_TIME = 1 << 15  # bounds the temporaries (a million values)


def dequantize_q4_1_q8_0(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Q4_1 or Q8_0 blocks → float32 values [blocks * 32], with gguf.quants' arithmetic (bit for bit)
    but over many blocks per numpy call: gguf.quants runs it 16 rows at a time (a 1536x576 Q4_1
    tensor took 7.9 ms there, 2.6 ms here; SmolLM2 has 210 of them and a Q8_0 embedding)."""
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, size)
    out = np.empty((blocks.shape[0], block), np.float32)
    for b0 in range(0, blocks.shape[0], _BLOCKS_AT_A_TIME):
        chunk = blocks[b0 : b0 + _BLOCKS_AT_A_TIME]
        values = out[b0 : b0 + len(chunk)]
        d = chunk[:, :2].view(np.float16).astype(np.float32)
        if qtype == GGMLQuantizationType.Q8_0:  # d, then 32 int8: x * d
            values[...] = chunk[:, 2:].view(np.int8)
            values *= d
        else:  # d, m, then 16 bytes: values 0-15 in the low nibbles, 16-31 in the high ones: d * q + m
            qs = chunk[:, 4:]
            q = np.empty((len(chunk), block), np.uint8)
            np.bitwise_and(qs, np.uint8(0x0F), out=q[:, : block // 2])
            np.right_shift(qs, np.uint8(4), out=q[:, block // 2 :])
            values[...] = q
            values *= d
            values += chunk[:, 2:4].view(np.float16).astype(np.float32)
    return out.reshape(-1)


def _nbytes(shape: tuple[int, ...], qtype: int) -> int:
    """Bytes the tensor takes in the file; -1 when the type is unknown (reported by the loader)."""
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        return -1
    n = int(np.prod(shape, dtype=np.int64))
    return n // block * type_size
