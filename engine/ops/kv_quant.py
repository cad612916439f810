"""The int8 KV cache's layout and the Python side of reading and writing it (`--kv-cache-dtype int8`).

A layer's int8 cache is ONE tensor [num_slots + 1, kv_heads, head_dim + 4] int8: each (slot, kv head) row holds its
head_dim values q and, in the 4 bytes after them, the row's fp32 scale s (symmetric absmax: s = max|x| / 127,
q = round(x / s), x ~ q * s). Keeping the scale inside the row, not in a side buffer, means every place that holds,
passes or compiles a layer's cache (the pools, the model's per-layer lists, the compiled decode step's inputs, whose
slot dimension is symbolic) carries the scales with no second list, and a row's values and scale are read together.
The C++ op (engine/ops/csrc/attention/decode_attention.h) reads the same layout; `quantize_rows` does the same fp32
operations in the same order as its writer, so both write identical bytes.

Decode attention dequantizes in registers (the C++ kernels) or per gathered row (the Python reference); prefill
dequantizes only the rows it gathers for a request (`gather_rows`), never a copy of the pool.
"""
from __future__ import annotations

import torch

SCALE_BYTES = 4  # one fp32 scale per (slot, kv head) row
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8")


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def row_elements(head_dim: int, dtype: torch.dtype) -> int:
    """A cache row's last dimension: head_dim, or head_dim + 4 for int8 (its scale)."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] int8 rows with their scale."""
    xf = x.float()
    # The C++ writer does these very fp32 operations (x times the reciprocal of absmax * fp32(1/127)), so both round
    # the same values and write the same bytes: a near-tie such as -63.500004 must go the same way in both.
    scale = xf.abs().amax(dim=-1, keepdim=True) * (1.0 / 127.0)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = (xf * inv).round().clamp(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)  # (a fp32 [..., 1] viewed as its 4 bytes)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] int8 rows -> [..., D] values in `dtype` (q * s computed in fp32)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :d].float() * scale).to(dtype)


def write_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache[slots] = x, quantized when the cache is int8 (converted when it is another float type)."""
    cache.index_copy_(0, slots, quantize_rows(x) if is_quantized(cache) else x.to(cache.dtype))


def gather_rows(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[slots] in `dtype`: only these rows are dequantized."""
    rows = cache[slots]
    return dequantize_rows(rows, dtype) if is_quantized(cache) else rows.to(dtype)
