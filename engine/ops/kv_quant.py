"""The int8 and fp8 KV caches' layout and the Python side of reading and writing them (`--kv-cache-dtype int8` or
`fp8_e4m3`).

A layer's int8 cache is ONE tensor [num_slots + 1, kv_heads, head_dim + 4] int8: each (slot, kv head) row holds its
head_dim values q and, in the 4 bytes after them, the row's fp32 scale s (symmetric absmax: s = max|x| / 127,
q = round(x / s), x ~ q * s). Keeping the scale inside the row, not in a side buffer, means every place that holds,
passes or compiles a layer's cache (the pools, the model's per-layer lists, the compiled decode step's inputs, whose
slot dimension is symbolic) carries the scales with no second list, and a row's values and scale are read together.
An fp8 cache is the same layout in torch.float8_e4m3fn: e4m3 values y = x / s with s = max|x| / 448. The C++ op
(engine/ops/csrc/attention/decode_attention.h) reads the same layouts; `quantize_rows` does the same fp32 operations in
the same order as its writer, so both write identical bytes.

Decode attention dequantizes in registers (the C++ kernels) or per gathered row (the Python reference); prefill
dequantizes only the rows it gathers for a request (`gather_rows`), never a copy of the pool.
"""
from __future__ import annotations

import torch

SCALE_BYTES = 4  # one fp32 scale per (slot, kv head) row
# The storage dtypes with a scale per row, and the largest magnitude each stores (e4m3fn's largest finite value).
SCALED: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in SCALED


def row_elements(head_dim: int, dtype: torch.dtype) -> int:
    """A cache row's last dimension: head_dim, or head_dim + 4 for int8 / fp8 (its scale)."""
    return head_dim + SCALE_BYTES if dtype in SCALED else head_dim


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] rows of `dtype` (int8 or float8_e4m3fn) with their scale."""
    qmax = SCALED[dtype]
    xf = x.float()
    # The C++ writer (engine/ops/csrc/attention/kv_write.h) does these very fp32 operations (x times the reciprocal of
    # absmax * fp32(1/qmax)), so both round the same values and write the same bytes: a near-tie such as -63.500004
    # must go the same way in both.
    scale = xf.abs().amax(dim=-1, keepdim=True) * (1.0 / qmax)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    y = xf * inv
    q = y.round().clamp(-qmax, qmax).to(torch.int8) if dtype == torch.int8 else y.clamp(-qmax, qmax).to(dtype)
    # (the fp32 scale [..., 1] as its 4 bytes; byte views because index_copy_ and cat have no fp8 kernels)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1).view(dtype)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] int8 / fp8 rows -> [..., D] values in `dtype` (q * s computed in fp32)."""
    d = rows.shape[-1] - SCALE_BYTES
    raw = rows.view(torch.uint8)
    scale = raw[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (raw[..., :d].view(rows.dtype).float() * scale).to(dtype)


def write_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache[slots] = x, quantized when the cache is int8 / fp8 (converted when it is another float type)."""
    if is_quantized(cache):
        cache.view(torch.uint8).index_copy_(0, slots, quantize_rows(x, cache.dtype).view(torch.uint8))
    else:
        cache.index_copy_(0, slots, x.to(cache.dtype))


def attended_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What a prefill chunk's queries attend of its own K/V `x`, just written to `slots`: x itself, or with an int8 /
    fp8 cache the values every later step reads (then a prompt's output does not depend on how it was chunked or how
    much of it the prefix cache held)."""
    return gather_rows(cache, slots, x.dtype) if is_quantized(cache) else x


def gather_rows(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[slots] in `dtype`: only these rows are dequantized."""
    return dequantize_rows(cache[slots], dtype) if is_quantized(cache) else cache[slots].to(dtype)
