"""A GGUF file's block-quantized weights kept as they are (`--quantization gguf`), not dequantized.

GGUF stores a linear weight [out, in] as rows of blocks of 32 values along `in`, each block with
its own float16 scale (and, for Q4_1, a float16 minimum). Those blocks are the windows of
`ops.linear`'s quantized layout, one scale per 32 rows of the reduction axis and column, so they
map onto it exactly, value for value:
- Q8_0 (d, 32 int8 q; value d·q) → int8 codes [K, N] and scales [K / 32, N];
- Q4_0 (d, 16 bytes of 4-bit q; value d·(q − 8)) and Q4_1 (d, m, 16 bytes; value d·q + m) → 4-bit
  codes in the CPU kernel's strips (two per byte), scales and offsets [K / 32, N] (−8·d for Q4_0).
The products d·q are exact in float32 (an 11-bit significand times a small integer), so
code·scale + offset rounds once, like gguf's own dequantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q

from .errors import ModelLoadError
from .gguf_reader import GGUFFile

BLOCK = 32  # values per block, every kept type
# the record of one block of each kept type, in file order
_RECORDS = {
    Q.Q8_0: np.dtype([("d", "<f2"), ("q", "i1", BLOCK)]),
    Q.Q4_0: np.dtype([("d", "<f2"), ("q", "u1", BLOCK // 2)]),
    Q.Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("q", "u1", BLOCK // 2)]),
}
KEPT = frozenset(_RECORDS)


@dataclass
class Blocks:
    """One linear weight's blocks in params orientation: x @ W with W [K, N]."""

    qtype: Q
    codes: np.ndarray  # int8 (Q8_0) or 4-bit codes 0..15 as uint8 (Q4_x), [K, N]
    scale: np.ndarray  # float32 [K / 32, N]
    offset: np.ndarray | None  # float32 [K / 32, N] for 4-bit codes, else None

    @property
    def is_4bit(self) -> bool:
        return self.qtype != Q.Q8_0


def read_blocks(gf: GGUFFile, name: str, fix=None) -> Blocks:
    """The blocks of the linear weight `name` ([out, in] in the file); `fix(rows)` reorders the rows
    of an [out, ...] array (llama.cpp's permutation of Q and K), applied alike to codes and scales."""
    info = gf.tensors[name]
    qtype = Q(info.qtype)
    if qtype not in KEPT:
        raise ModelLoadError(
            f"{gf.path}: tensor {name!r} is {qtype.name}; --quantization gguf keeps "
            f"{', '.join(sorted(t.name for t in KEPT))} blocks (without it, the weights are dequantized to float)"
        )
    out, inp = info.shape
    blocks = gf.raw(name).reshape(-1).view(_RECORDS[qtype]).reshape(out, inp // BLOCK)
    d = blocks["d"].astype(np.float32)
    if qtype == Q.Q8_0:
        codes, offset = blocks["q"].reshape(out, inp), None
    else:  # byte j of a block: value j in its low nibble, value j + 16 in its high one
        q = blocks["q"]
        codes = np.concatenate([q & 0x0F, q >> 4], axis=-1).reshape(out, inp)
        offset = -8.0 * d if qtype == Q.Q4_0 else blocks["m"].astype(np.float32)
    if fix is not None:
        codes, d = fix(codes), fix(d)
        offset = None if offset is None else fix(offset)
    return Blocks(qtype, np.ascontiguousarray(codes.T), np.ascontiguousarray(d.T),
                  None if offset is None else np.ascontiguousarray(offset.T))


def stack_blocks(per_layer: list[Blocks], what: str) -> Blocks:
    """The layers' blocks of one projection stacked on a leading axis (codes [L, K, N]); every layer
    must hold the same type."""
    types = {b.qtype for b in per_layer}
    if len(types) > 1:
        raise ModelLoadError(
            f"--quantization gguf: the layers of {what} mix {', '.join(sorted(t.name for t in types))}; "
            "a projection is kept in one block type across its layers"
        )
    first = per_layer[0]
    return Blocks(
        first.qtype, np.stack([b.codes for b in per_layer]), np.stack([b.scale for b in per_layer]),
        None if first.offset is None else np.stack([b.offset for b in per_layer]),
    )
