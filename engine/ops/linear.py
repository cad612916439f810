"""Linear layers over weights packed for `ember::linear_bf16` (engine/ops/csrc/linear_bf16.cpp).

A packed weight is [N_pad / 32, K / 2, 32, 2] bf16: blocks of 32 output columns, each a run of (column, input
pair) values. The model keeps ONLY the packed copy, shared by eager prefill and every compiled decode bucket;
`linear` and `embedding` accept either layout, so fp32 and machines without AVX512-BF16 use plain [N, K] weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops.native import NATIVE_LINEAR

BLOCK = 32


def can_pack(dtype: torch.dtype) -> bool:
    return NATIVE_LINEAR and dtype == torch.bfloat16


def pack_linear_weight(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 32), K / 2, 32, 2]; padded columns are zero. K must be even."""
    n, k = w.shape
    if k % 2:
        raise ValueError(f"packed linear needs an even input size, got {k}")
    blocks = -(-n // BLOCK)
    padded = F.pad(w, (0, 0, 0, blocks * BLOCK - n))
    return padded.view(blocks, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_linear_weight(packed: torch.Tensor, n: int) -> torch.Tensor:
    blocks, k2 = packed.shape[0], packed.shape[1]
    return packed.permute(0, 2, 1, 3).reshape(blocks * BLOCK, 2 * k2)[:n]


def reference_linear_bf16(x: torch.Tensor, w_packed: torch.Tensor, n: int) -> torch.Tensor:
    """What ember::linear_bf16 computes, in plain torch (the test oracle)."""
    return F.linear(x, unpack_linear_weight(w_packed, n))


def linear(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    """x @ w.T for a plain [n, K] or a packed weight (a static branch: dynamo sees one or the other)."""
    if w.dim() == 4:
        return torch.ops.ember.linear_bf16(x, w, n)
    return F.linear(x, w)


def embedding(ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a plain [V, K] or packed embedding table (tied heads keep one packed copy)."""
    if w.dim() == 4:
        # Row r lives in block r // 32 at column r % 32, spread over the K / 2 pairs: [T, K / 2, 2] -> [T, K].
        return w[ids // BLOCK, :, ids % BLOCK, :].reshape(ids.shape[0], -1)
    return F.embedding(ids, w)
