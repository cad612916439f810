"""GGUF quantized weights kept in their own block bytes: the layout `ember::linear_gguf` reads, and its fallbacks.

A GGUF tensor of a block type is, per row, `row_bytes = K / block_values * block_bytes` bytes of blocks
(ggml-common.h). `interleave` only permutes them, in groups of `group_rows(qtype)` rows, so the kernel computing a
group reads one sequential stream; the last group is padded with zero rows (which dequantize to 0). Nothing is
widened: the op reads exactly the file's bytes (engine/ops/csrc/linear_gguf/linear_gguf.h). Two layouts:
- 4-row groups (Q5_0, Q5_1, Q5_K): within group g (rows 4g..4g+3) block b of row r sits whole at byte
  (4 * b + r) * block_bytes.
- 16-row groups, rows in the lanes (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K): block b of a group is 16 * block_bytes bytes:
  the 16 rows' fp16 d (Q6_K's, which its blocks store last), for Q4_1 / Q4_K their fp16 m / dmin, then the rest of
  the block (Q4_K: its 12 scale bytes, then the codes) in chunks of 4 bytes per row, chunk by chunk (chunk c: bytes
  4c..4c+3 of row 0, of row 1, .. of row 15), so one SIMD dot of a chunk covers 16 rows. Q6_K's rest goes in the
  order its kernel reads it: the 16 scales, then per half of the block its 64 low-nibble bytes and 32 high-bit
  bytes (file bytes 192-207, 0-63, 128-159, 64-127, 160-191).

`dequantize` (gguf.quants.dequantize) is the oracle; `linear` and `rows` fall back to it without native ops.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from engine.ops.native import NATIVE_OPS

_T = GGMLQuantizationType
# ggml type id -> (name, values per block, bytes per block)
GGUF_TYPES: dict[int, tuple[str, int, int]] = {
    int(t): (t.name, *GGML_QUANT_SIZES[t])
    for t in (_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.Q4_K, _T.Q5_K, _T.Q6_K)
}
ROW_GROUP = 4  # the 4-row layout's group
# the 16-row layout's types
X16_TYPES = frozenset({int(_T.Q4_0), int(_T.Q4_1), int(_T.Q8_0), int(_T.Q4_K), int(_T.Q6_K)})


def group_rows(qtype: int) -> int:
    """Rows per interleaved group of a type's layout: 16 (X16_TYPES) or 4."""
    return 16 if int(qtype) in X16_TYPES else ROW_GROUP


def _x16_fields(qtype: int) -> tuple[slice, list[slice]]:
    """Where in a file block of a 16-row type its fp16 scales (d, and Q4_1's m / Q4_K's dmin) lie, and the rest in
    the layout's order (the module docstring): the scales first and the rest in order, but Q6_K's d last."""
    size = _info(qtype)[2]
    if int(qtype) == int(_T.Q6_K):
        return slice(208, 210), [slice(192, 208), slice(0, 64), slice(128, 160), slice(64, 128), slice(160, 192)]
    head = 4 if int(qtype) in (int(_T.Q4_1), int(_T.Q4_K)) else 2
    return slice(0, head), [slice(head, size)]


def _info(qtype: int) -> tuple[str, int, int]:
    if int(qtype) not in GGUF_TYPES:
        names = ", ".join(f"{name}={t}" for t, (name, _, _) in GGUF_TYPES.items())
        raise ValueError(f"unsupported ggml type {int(qtype)} (supported: {names})")
    return GGUF_TYPES[int(qtype)]


def _check_rows(raw: torch.Tensor, qtype: int) -> tuple[int, int]:
    """(blocks per row, block bytes) of a uint8 [N, row_bytes] tensor of GGUF rows."""
    _, _, size = _info(qtype)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % size:
        raise ValueError(f"GGUF rows must be uint8 [N, k * {size}], got {raw.dtype} {tuple(raw.shape)}")
    return raw.shape[1] // size, size


def interleave(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """uint8 [N, row_bytes] (GGUF rows, as the file stores them) -> uint8 [ceil(N/G), G*row_bytes], G =
    group_rows(qtype), laid out as the module docstring says (the last group padded with zero rows). A pure byte
    permutation: the same bytes as the file."""
    nb, size = _check_rows(raw, qtype)
    n, g = raw.shape[0], group_rows(qtype)
    groups = -(-n // g)
    if n % g:
        padded = raw.new_zeros((groups * g, raw.shape[1]))
        padded[:n] = raw
    else:
        padded = raw.contiguous()
    blocks = padded.view(groups, g, nb, size).transpose(1, 2)  # [groups, nb, g, size]
    if g == ROW_GROUP:
        return blocks.contiguous().view(groups, g * nb * size)
    # Copied straight into place through views (one pass, no intermediate copies: a load's peak memory is the
    # largest weight twice, not four times).
    hs, rest = _x16_fields(qtype)
    head = hs.stop - hs.start
    out = raw.new_empty((groups, nb, g * size))
    out[..., : g * head].view(groups, nb, head // 2, g, 2).copy_(
        blocks[..., hs].unflatten(-1, (head // 2, 2)).transpose(2, 3))  # [.., field, row, 2 bytes]
    at = g * head
    for part in rest:  # [.., chunk, row, 4 bytes]
        n_bytes = part.stop - part.start
        out[..., at : at + g * n_bytes].view(groups, nb, n_bytes // 4, g, 4).copy_(
            blocks[..., part].unflatten(-1, (n_bytes // 4, 4)).transpose(2, 3))
        at += g * n_bytes
    return out.view(groups, g * nb * size)


def deinterleave(packed: torch.Tensor, qtype: int, n: int) -> torch.Tensor:
    """The inverse of `interleave`: [ceil(N/G), G*row_bytes] -> [N, row_bytes] GGUF rows."""
    _, _, size = _info(qtype)
    g = group_rows(qtype)
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] % (g * size):
        raise ValueError(f"not an interleaved {GGUF_TYPES[int(qtype)][0]} weight: {packed.dtype} "
                         f"{tuple(packed.shape)}")
    if not g * (packed.shape[0] - 1) < n <= g * packed.shape[0]:
        raise ValueError(f"{tuple(packed.shape)} is not an interleaved weight of {n} rows")
    groups, nb = packed.shape[0], packed.shape[1] // (g * size)
    if g == ROW_GROUP:
        blocks = packed.view(groups, nb, g, size)
    else:
        hs, rest = _x16_fields(qtype)
        head = hs.stop - hs.start
        per_block = packed.view(groups, nb, g * size)
        blocks = packed.new_empty((groups, nb, g, size))
        blocks[..., hs] = per_block[..., : g * head].reshape(groups, nb, head // 2, g, 2).transpose(2, 3).reshape(
            groups, nb, g, head)
        at = g * head
        for part in rest:
            n_bytes = part.stop - part.start
            chunks = per_block[..., at : at + g * n_bytes].reshape(groups, nb, n_bytes // 4, g, 4).transpose(2, 3)
            blocks[..., part] = chunks.reshape(groups, nb, g, n_bytes)
            at += g * n_bytes
    rows = blocks.transpose(1, 2).reshape(groups * g, nb * size)
    return rows[:n].contiguous()


def dequantize(raw: torch.Tensor, qtype: int, n_cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GGUF rows uint8 [N, row_bytes] -> [N, n_cols] in `dtype`, by gguf.quants.dequantize (the oracle)."""
    nb, _ = _check_rows(raw, qtype)
    if nb * _info(qtype)[1] != n_cols:
        raise ValueError(f"{raw.shape[1]} bytes per row are not {n_cols} {GGUF_TYPES[int(qtype)][0]} values")
    values = gguf_quants.dequantize(raw.contiguous().numpy(), GGMLQuantizationType(int(qtype)))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(raw.shape[0], n_cols).to(dtype)


def _n_cols(packed: torch.Tensor, qtype: int) -> int:
    _, values, size = _info(qtype)
    return packed.shape[1] // group_rows(qtype) // size * values


def linear(x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int, f32_out: bool = False) -> torch.Tensor:
    """y[..., n] = x[..., K] @ W^T for an interleaved GGUF weight of n rows; x (and y) bf16 or fp32, y fp32 with
    f32_out (the output head: logits straight from the fp32 sums, not rounded to x's dtype first).

    Native: ember::linear_gguf (int8 activations below 16 rows, exact fp32 weights above). Fallback: x against
    the gguf-dequantized weight."""
    if NATIVE_OPS:
        op = torch.ops.ember.linear_gguf_f32 if f32_out else torch.ops.ember.linear_gguf
        return op(x, packed, int(qtype), n)
    w = dequantize(deinterleave(packed, qtype, n), qtype, _n_cols(packed, qtype))
    y = x.float() @ w.T
    return y if f32_out else y.to(x.dtype)


def rows(packed: torch.Tensor, ids: torch.Tensor, qtype: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the weight (embedding lookups), [*ids.shape, K] in `dtype`: exactly gguf's dequantization
    (bf16: rounded to nearest even from it)."""
    if NATIVE_OPS:
        return torch.ops.ember.gguf_rows(packed, ids, int(qtype), n, dtype)
    raw = deinterleave(packed, qtype, n)[ids.reshape(-1).long()]
    return dequantize(raw, qtype, _n_cols(packed, qtype)).to(dtype).reshape(*ids.shape, -1)
