"""GGUF quantized weights kept in their own block bytes: the layout `ember::linear_gguf` reads, and its fallbacks.

A GGUF tensor of a block type is, per row, `row_bytes = K / block_values * block_bytes` bytes of blocks
(ggml-common.h). `interleave` only permutes them: rows 4g..4g+3 form group g, and within a group block b of row
r sits at byte offset (4 * b + r) * block_bytes, so the kernel computing a group's 4 rows reads one sequential
stream; the last group is padded with zero rows (at most 3 rows of zero bytes, which dequantize to 0). Nothing is
widened or repacked: the op reads exactly the file's bytes (engine/ops/csrc/linear_gguf/linear_gguf.h).

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
ROW_GROUP = 4


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
    """uint8 [N, row_bytes] (GGUF rows, as the file stores them) -> uint8 [ceil(N/4), 4*row_bytes]: rows 4g..4g+3
    form group g; within a group, block b of row r sits at byte offset (4*b + r) * block_bytes (the last group
    padded with zero rows). A pure byte permutation: same bytes as the file."""
    nb, size = _check_rows(raw, qtype)
    n = raw.shape[0]
    groups = -(-n // ROW_GROUP)
    padded = raw.new_zeros((groups * ROW_GROUP, raw.shape[1]))
    padded[:n] = raw
    return padded.view(groups, ROW_GROUP, nb, size).transpose(1, 2).contiguous().view(groups, ROW_GROUP * nb * size)


def deinterleave(packed: torch.Tensor, qtype: int, n: int) -> torch.Tensor:
    """The inverse of `interleave`: [ceil(N/4), 4*row_bytes] -> [N, row_bytes] GGUF rows."""
    _, _, size = _info(qtype)
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] % (ROW_GROUP * size):
        raise ValueError(f"not an interleaved {GGUF_TYPES[int(qtype)][0]} weight: {packed.dtype} "
                         f"{tuple(packed.shape)}")
    if not ROW_GROUP * (packed.shape[0] - 1) < n <= ROW_GROUP * packed.shape[0]:
        raise ValueError(f"{tuple(packed.shape)} is not an interleaved weight of {n} rows")
    groups, nb = packed.shape[0], packed.shape[1] // (ROW_GROUP * size)
    rows = packed.view(groups, nb, ROW_GROUP, size).transpose(1, 2).reshape(groups * ROW_GROUP, nb * size)
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
    return packed.shape[1] // ROW_GROUP // size * values


def linear(x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int) -> torch.Tensor:
    """y[..., n] = x[..., K] @ W^T for an interleaved GGUF weight of n rows; x (and y) bf16 or fp32.

    Native: ember::linear_gguf (int8 activations below 16 rows, exact fp32 weights above). Fallback: x against
    the gguf-dequantized weight."""
    if NATIVE_OPS:
        return torch.ops.ember.linear_gguf(x, packed, int(qtype), n)
    w = dequantize(deinterleave(packed, qtype, n), qtype, _n_cols(packed, qtype))
    return (x.float() @ w.T).to(x.dtype)


def rows(packed: torch.Tensor, ids: torch.Tensor, qtype: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the weight (embedding lookups), [*ids.shape, K] in `dtype`: exactly gguf's dequantization
    (bf16: rounded to nearest even from it)."""
    if NATIVE_OPS:
        return torch.ops.ember.gguf_rows(packed, ids, int(qtype), n, dtype)
    raw = deinterleave(packed, qtype, n)[ids.reshape(-1).long()]
    return dequantize(raw, qtype, _n_cols(packed, qtype)).to(dtype).reshape(*ids.shape, -1)
