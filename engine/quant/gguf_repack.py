"""Repack GGUF block-quantized weights into Ember's QuantizedTensor (format.py), losslessly.

`repack(raw, qtype, n_cols)` takes what gguf.GGUFReader gives as `tensor.data` for a quantized 2-D tensor, a
uint8 array [N, bytes_per_row], and returns qweight/scales/mins whose `dequantize` (fp32: q * scale + min)
equals gguf.quants.dequantize(raw, qtype) (the oracle) bit for bit, for every supported type:
  type  gguf computes (fp32)          qweight       scales     mins           G
  Q8_0  d * q                         int8 q        fp16 d     -              32
  Q4_0  d * (q - 8)                   4-bit q       fp16 d     fp16 -8d       32
  Q4_1  d * q + m                     4-bit q       fp16 d     fp16 m         32
  Q5_0  d * (q - 16)                  int8 q - 16   fp16 d     -              32
  Q5_1  d * q + m                     int8 q        fp16 d     fp16 m         32
  Q4_K  (d * sc) * q - (dmin * mn)    4-bit q       fp32 d*sc  fp32 -dmin*mn  32
  Q5_K  (d * sc) * q - (dmin * mn)    int8 q        fp32 d*sc  fp32 -dmin*mn  32
  Q6_K  (d * sc) * (q - 32)           int8 q - 32   fp32 d*sc  -              16
Why exact: d, dmin are fp16 (at most 11 significant bits) and the sub-scales sc, mn integers of at most 8
bits, so d*sc and dmin*mn are exact in fp32 (gguf forms them first too), and so is every scale * q product
except Q6_K's, where ours is the same single rounding as gguf's (d*sc) * (q-32). Q4_0's -8d is exact in fp16
(a power-of-two scaling) and d*q - 8d is the exact d*(q-8). So the only rounding is the final + min, the same
as gguf's; a kernel that fuses it into an FMA gets the same result too, the product being exact. Not bitwise:
where gguf yields -0.0 (Q4_0, d < 0, q = 8) Ember yields +0.0.

Everything is vectorized numpy over [N, blocks, ...] arrays: no Python loop per block or row.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.quant.format import QuantizedTensor, pack_nibbles

T = GGMLQuantizationType
SUPPORTED_GGUF_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K})

# fp16's largest finite value is 65504: -8 * d overflows fp16 for |d| >= 8192 (the next fp16 after 8188).
_Q4_0_FP16_MIN_LIMIT = 8192.0


def _field(blocks: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Bytes [start, stop) of every block, [N, nb, stop - start], as a fresh contiguous array.

    Always a copy: `raw` is typically a read-only memmap of the GGUF file, and the result must neither alias it
    (torch.from_numpy warns on read-only arrays and would share the mapping) nor be a strided view."""
    return blocks[..., start:stop].copy()


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at byte `offset` of every block, [N, nb] float16 (GGUF is little-endian)."""
    return _field(blocks, offset, offset + 2).view("<f2")[..., 0].astype(np.float16)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[N, nb, chunks * width] bytes -> [N, nb, chunks, 2, width] uint8: low nibbles, then high nibbles, of
    each `width`-byte chunk (the value order of every GGUF type here, with width 16, 32 or 64)."""
    n, nb, size = qs.shape
    chunks = qs.reshape(n, nb, size // width, 1, width)
    return (chunks >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & np.uint8(0x0F)


def _qh_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4-byte qh (uint32 LE, bit j = 5th bit of value j) -> [N, nb, 32] uint8 0/1.

    Little-endian bit j is bit j % 8 of byte j // 8, so this works on bytes (no 4x wider uint32 array)."""
    n, nb, _ = qh.shape
    bits = qh.reshape(n, nb, 4, 1) >> np.arange(8, dtype=np.uint8)
    return (bits & np.uint8(1)).reshape(n, nb, 32)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit sub-scales and sub-mins -> two [N, nb, 8] uint8 arrays.

    Bytes 0-3 hold sc[0..3] in their low 6 bits, 4-7 hold m[0..3]; bytes 8-11 hold the low 4 bits of sc[4..7]
    (low nibble) and m[4..7] (high nibble), whose top 2 bits are the top 2 bits of bytes 0-3 / 4-7."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_super_scales(d: np.ndarray, sub: np.ndarray) -> np.ndarray:
    """float32(d) * sub in float32, [N, nb, S] -> [N, nb * S]: gguf's own product (exact: an 11-bit mantissa
    times an integer of at most 8 bits fits fp32's 24), so q * it rounds exactly as gguf's (d * sc) * q."""
    n = d.shape[0]
    return (d.astype(np.float32)[..., None] * sub.astype(np.float32)).reshape(n, -1)


def _torch(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def _int8(values: np.ndarray, offset: int = 0) -> torch.Tensor:
    """uint8 values [N, nb, ...] -> qweight int8 [N, K] holding values - offset. Subtracting in uint8 wraps
    modulo 256, so reinterpreting the bytes as int8 gives values - offset exactly when it is in -128..127,
    without a wider intermediate array."""
    return _torch((values - np.uint8(offset)).view(np.int8).reshape(values.shape[0], -1))


def repack(raw: np.ndarray, qtype: GGMLQuantizationType, n_cols: int) -> QuantizedTensor:
    """GGUF quantized tensor bytes [N, bytes_per_row] (N output rows, n_cols = K) -> QuantizedTensor [N, K].

    Raises ValueError for an unsupported type or bytes that do not match (N, K) for `qtype`."""
    if qtype not in SUPPORTED_GGUF_TYPES:
        name = getattr(qtype, "name", repr(qtype))
        supported = ", ".join(sorted(t.name for t in SUPPORTED_GGUF_TYPES))
        raise ValueError(f"GGUF tensor type {name} cannot be repacked into Ember's quantized format "
                         f"(supported: {supported})")
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2:
        raise ValueError(f"{qtype.name}: expected uint8 bytes [rows, bytes_per_row], got {raw.dtype} {raw.shape}")
    if n_cols <= 0 or n_cols % block:
        raise ValueError(f"{qtype.name}: row length {n_cols} is not a positive multiple of the block size {block}")
    n, nb = raw.shape[0], n_cols // block
    if raw.shape[1] != nb * type_size:
        raise ValueError(f"{qtype.name}: {raw.shape[1]} bytes per row, expected {nb * type_size} for {n_cols} "
                         f"columns ({nb} blocks of {type_size} bytes)")
    blocks = raw.reshape(n, nb, type_size)
    qweight: torch.Tensor
    mins: torch.Tensor | None = None

    if qtype == T.Q8_0:  # d, qs[32]
        qweight = _torch(_field(blocks, 2, 34).view(np.int8).reshape(n, n_cols))
        scales = _torch(_f16(blocks, 0))

    elif qtype in (T.Q4_0, T.Q4_1):  # d, [m,] qs[16]: already Ember's nibble order, taken as is
        off = 2 if qtype == T.Q4_0 else 4
        qweight = _torch(_field(blocks, off, off + 16).reshape(n, n_cols // 2))
        d = _f16(blocks, 0)
        if qtype == T.Q4_1:
            scales, mins = _torch(d), _torch(_f16(blocks, 2))
        elif np.any(np.abs(d.astype(np.float32)) >= _Q4_0_FP16_MIN_LIMIT):
            # -8d would overflow fp16; fp32 holds d and -8d exactly, so the tensor stays lossless, in a layout
            # with fp32 scales. Real weights never get here: it takes a block whose max |w| is >= 65536.
            d32 = d.astype(np.float32)
            scales, mins = _torch(d32), _torch(np.float32(-8) * d32)
        else:
            scales, mins = _torch(d), _torch(np.float16(-8) * d)  # exact: a power-of-two scaling

    elif qtype in (T.Q5_0, T.Q5_1):  # d, [m,] qh[4], qs[16]
        off = 2 if qtype == T.Q5_0 else 4
        low = _nibbles(_field(blocks, off + 4, off + 20), 16).reshape(n, nb, 32)  # values j, then j + 16
        q = low | (_qh_bits(_field(blocks, off, off + 4)) << np.uint8(4))
        if qtype == T.Q5_0:
            qweight, scales = _int8(q, 16), _torch(_f16(blocks, 0))
        else:
            qweight, scales, mins = _int8(q), _torch(_f16(blocks, 0)), _torch(_f16(blocks, 2))

    elif qtype in (T.Q4_K, T.Q5_K):  # d, dmin, scales[12], [qh[32],] qs[128]; 8 sub-blocks of 32
        sc, mn = _k_scale_min(_field(blocks, 4, 16))
        scales = _torch(_k_super_scales(_f16(blocks, 0), sc))
        mins = _torch(-_k_super_scales(_f16(blocks, 2), mn))  # negation is exact: q*s + (-dm) == q*s - dm
        qs_off = 16 if qtype == T.Q4_K else 48
        # Each 32-byte chunk c of qs holds sub-block 2c in its low nibbles and 2c + 1 in its high nibbles.
        q = _nibbles(_field(blocks, qs_off, qs_off + 128), 32).reshape(n, nb, 8, 32)
        if qtype == T.Q4_K:
            # Ember pairs value j with j + 16 inside each 32-group instead: unpack to values, pack again.
            qweight = pack_nibbles(_torch(q.reshape(n, n_cols)))
        else:
            # Bit i of qh byte j is the 5th bit of value j of sub-block i.
            qh = _field(blocks, 16, 48).reshape(n, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
            qweight = _int8(q | ((qh & np.uint8(1)) << np.uint8(4)))

    else:  # Q6_K: ql[128], qh[64], scales[16] int8, d; 16 sub-blocks of 16
        # ql: two halves of 64 bytes; each half's low nibbles are values 0..63 of its 128, high nibbles 64..127.
        # qh: two halves of 32 bytes; bit pair 2i of byte j is the top 2 bits of value 32i + j of its half.
        ql = _nibbles(_field(blocks, 0, 128), 64).reshape(n, nb, 2, 4, 32)
        qh = _field(blocks, 128, 192).reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        q = ql | ((qh & np.uint8(3)) << np.uint8(4))
        qweight = _int8(q, 32)
        sub = _field(blocks, 192, 208).view(np.int8)
        scales = _torch(_k_super_scales(_f16(blocks, 208), sub))

    return QuantizedTensor(qweight, scales, mins, qtype.name)
