"""Ember's quantized weight format, shared by every source (GGUF block types, int8/int4 quantized at load) and read
by the `ember::linear_q` kernels (engine/ops/csrc/linear_q/).

A weight W [N, K] is row-major, one output row after another, so fused projections (q|k|v, gate|up) are a
concatenation of rows and a row permutation (llama.cpp's Q/K order) permutes qweight, scales and mins alike:
  qweight  uint8 [N, K / 2]: 4-bit values 0..15. Within each 32-value group of a row, byte j (0..15) holds
           value j in its low nibble and value j + 16 in its high nibble (GGUF's Q4_0/Q4_1 order, which unpacks
           with one shift and one mask into 32 bytes in order).
        or int8 [N, K]: 8-bit signed values.
  scales   float16 or float32 [N, K / G]: G is the group size, K / scales.shape[1]; 16 (8-bit only) or a
           multiple of 32.
  mins     same shape and dtype as scales, or None (no offset).
  W[n, k] = scales[n, k // G] * q[n, k] + mins[n, k // G]
float16 scales where the source's scales are exactly float16 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, int4 at load);
float32 where they are products that float16 cannot hold exactly (the K-quants' super-block scale times a
6- or 8-bit sub-scale).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedTensor:
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    source: str  # what it was made from ("Q4_1", "Q6_K", "int8", ...): logs and tests

    @property
    def bits(self) -> int:
        return 4 if self.qweight.dtype == torch.uint8 else 8

    @property
    def shape(self) -> tuple[int, int]:
        n, cols = self.qweight.shape
        return n, cols * 2 if self.bits == 4 else cols

    @property
    def group(self) -> int:
        return self.shape[1] // self.scales.shape[1]

    @property
    def layout(self) -> tuple[int, torch.dtype, bool, int]:
        """Tensors with the same layout can be concatenated along N into one weight (one kernel call)."""
        return self.bits, self.scales.dtype, self.mins is not None, self.group

    def validate(self) -> None:
        n, k = self.shape
        if self.qweight.dtype not in (torch.uint8, torch.int8) or self.qweight.dim() != 2:
            raise ValueError(f"qweight must be a 2-D uint8 (4-bit) or int8 (8-bit) tensor, got {self.qweight.dtype}")
        if self.scales.dtype not in (torch.float16, torch.float32) or self.scales.shape[0] != n:
            raise ValueError(f"scales must be float16/float32 [{n}, K/G], got {self.scales.dtype} {tuple(self.scales.shape)}")
        g = self.group
        if k % self.scales.shape[1] or not (g % 32 == 0 or (g == 16 and self.bits == 8)):
            raise ValueError(f"group size {k}/{self.scales.shape[1]} must be a multiple of 32 (or 16 for 8-bit)")
        if self.mins is not None and (self.mins.shape != self.scales.shape or self.mins.dtype != self.scales.dtype):
            raise ValueError("mins must have the shape and dtype of scales")

    def rows(self, index: torch.Tensor) -> QuantizedTensor:
        """Rows `index` (a permutation or a selection) of the weight."""
        mins = None if self.mins is None else self.mins[index]
        return QuantizedTensor(self.qweight[index], self.scales[index], mins, self.source)


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Stack weights of one layout along N (fused q|k|v, gate|up)."""
    if len({p.layout for p in parts}) != 1:
        raise ValueError("only weights of one layout can be concatenated")
    mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])  # type: ignore[misc]
    sources = "+".join(sorted({p.source for p in parts}))
    return QuantizedTensor(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), mins, sources)


def unpack_values(qweight: torch.Tensor) -> torch.Tensor:
    """The integer values, [rows, K] int16 (either width), in order. Traceable by dynamo (embedding lookups)."""
    if qweight.dtype == torch.int8:
        return qweight.to(torch.int16)
    rows, half = qweight.shape
    groups = qweight.view(rows, half // 16, 16).to(torch.int16)
    return torch.cat([groups & 0xF, groups >> 4], dim=-1).reshape(rows, half * 2)


def dequantize_rows(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W for the given rows, computed in fp32 (the kernels' arithmetic) and cast to `dtype`."""
    values = unpack_values(qweight).float()
    rows, k = values.shape
    groups = scales.shape[1]
    w = values.view(rows, groups, k // groups) * scales.float().unsqueeze(-1)
    if mins is not None:
        w = w + mins.float().unsqueeze(-1)
    return w.view(rows, k).to(dtype)


def dequantize(t: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_rows(t.qweight, t.scales, t.mins, dtype)


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """[rows, K] integers 0..15 (K a multiple of 32) -> qweight uint8 [rows, K / 2] in the order above."""
    rows, k = values.shape
    v = values.to(torch.uint8).view(rows, k // 32, 2, 16)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(rows, k // 2)


ROW_GROUP = 4  # rows interleaved per packed group (engine/ops/csrc/linear_q/linear_q.h)


@dataclass
class PackedQuantized:
    """A QuantizedTensor in the kernels' layout: rows in groups of 4, each group's blocks of 32 interleaving its
    rows (so 4 rows at once are one sequential stream), the last group padded with zero rows."""

    qweight: torch.Tensor  # [ceil(N / 4), 4 * row bytes]
    scales: torch.Tensor   # [ceil(N / 4), 4 * K / G]
    mins: torch.Tensor | None
    n: int


def _interleave(a: torch.Tensor, unit: int) -> torch.Tensor:
    """[N, C] -> [ceil(N / 4), 4 * C]: per group of 4 rows, units of `unit` columns interleaved by row."""
    n, c = a.shape
    padded = torch.nn.functional.pad(a, (0, 0, 0, -n % ROW_GROUP)) if n % ROW_GROUP else a
    g = padded.shape[0] // ROW_GROUP
    return padded.view(g, ROW_GROUP, c // unit, unit).transpose(1, 2).reshape(g, ROW_GROUP * c).contiguous()


def _deinterleave(a: torch.Tensor, unit: int, n: int) -> torch.Tensor:
    g, c4 = a.shape
    c = c4 // ROW_GROUP
    return a.view(g, c // unit, ROW_GROUP, unit).transpose(1, 2).reshape(g * ROW_GROUP, c)[:n]


def pack(t: QuantizedTensor) -> PackedQuantized:
    t.validate()
    unit = 16 if t.bits == 4 else 32  # bytes of one row's block of 32 values
    mins = None if t.mins is None else _interleave(t.mins, 1)
    return PackedQuantized(_interleave(t.qweight, unit), _interleave(t.scales, 1), mins, t.shape[0])


def unpack(p: PackedQuantized, source: str) -> QuantizedTensor:
    unit = 16 if p.qweight.dtype == torch.uint8 else 32
    mins = None if p.mins is None else _deinterleave(p.mins, 1, p.n)
    return QuantizedTensor(_deinterleave(p.qweight, unit, p.n), _deinterleave(p.scales, 1, p.n), mins, source)


def packed_rows(p: PackedQuantized, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of W from the packed layout (embedding lookups), without unpacking the rest."""
    unit = 16 if p.qweight.dtype == torch.uint8 else 32
    g, r = ids // ROW_GROUP, ids % ROW_GROUP
    q = p.qweight.view(p.qweight.shape[0], -1, ROW_GROUP, unit)[g, :, r].reshape(ids.shape[0], -1)
    groups = p.scales.shape[1] // ROW_GROUP
    s = p.scales.view(-1, groups, ROW_GROUP)[g, :, r]
    m = None if p.mins is None else p.mins.view(-1, groups, ROW_GROUP)[g, :, r]
    return dequantize_rows(q, s, m, dtype)
