"""Linear layers over weights packed for `ember::linear_bf16` / `ember::linear_f32` (engine/ops/csrc/linear/).

A packed bf16 weight is [N_pad / 32, K / 2, 32, 2]: blocks of 32 output columns, each a run of (column, input pair)
values. A packed fp32 weight is [N_pad / 32, K, 32]: blocks of 32 output columns, a row of 32 per input. The model
keeps ONLY the packed copy, shared by eager prefill and every compiled decode bucket; `linear` and `embedding`
accept any of the three layouts (the rank tells them apart), so a tier without packed kernels keeps plain [N, K].
A quantized weight (engine/quant/) is a module instead of a tensor, and runs ember::linear_q on every tier.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops.native import NATIVE_LINEAR
from engine.quant.module import QuantizedWeight

BLOCK = 32


def can_pack(dtype: torch.dtype) -> bool:
    return NATIVE_LINEAR and dtype in (torch.bfloat16, torch.float32)


def pack_linear_weight(w: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] -> [ceil(N / 32), K / 2, 32, 2] (K must be even); fp32 [N, K] -> [ceil(N / 32), K, 32].
    Padded columns are zero."""
    n, k = w.shape
    blocks = -(-n // BLOCK)
    padded = F.pad(w, (0, 0, 0, blocks * BLOCK - n))
    if w.dtype == torch.float32:
        return padded.view(blocks, BLOCK, k).permute(0, 2, 1).contiguous()
    if k % 2:
        raise ValueError(f"packed bf16 linear needs an even input size, got {k}")
    return padded.view(blocks, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_linear_weight(packed: torch.Tensor, n: int) -> torch.Tensor:
    blocks = packed.shape[0]
    if packed.dim() == 3:
        return packed.permute(0, 2, 1).reshape(blocks * BLOCK, packed.shape[1])[:n]
    return packed.permute(0, 2, 1, 3).reshape(blocks * BLOCK, 2 * packed.shape[1])[:n]


def reference_linear(x: torch.Tensor, w_packed: torch.Tensor, n: int) -> torch.Tensor:
    """What ember::linear_bf16 / linear_f32 compute, in plain torch (the test oracle)."""
    return F.linear(x, unpack_linear_weight(w_packed, n))


def linear(x: torch.Tensor, w: torch.Tensor | QuantizedWeight, n: int) -> torch.Tensor:
    """x @ w.T for a plain [n, K], a packed or a quantized weight (a static branch: dynamo sees one of them)."""
    if isinstance(w, QuantizedWeight):
        return w(x)
    if w.dim() == 4:
        return torch.ops.ember.linear_bf16(x, w, n)
    if w.dim() == 3:
        return torch.ops.ember.linear_f32(x, w, n)
    return F.linear(x, w)


def embedding(ids: torch.Tensor, w: torch.Tensor | QuantizedWeight,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` of a plain [V, K], packed or quantized embedding table (tied heads keep one copy); a quantized
    table's rows come out in `dtype`, the others' in their own."""
    if isinstance(w, QuantizedWeight):
        return w.rows(ids, dtype)
    if w.dim() == 4:
        # Row r lives in block r // 32 at column r % 32, spread over the K / 2 pairs: [T, K / 2, 2] -> [T, K].
        return w[ids // BLOCK, :, ids % BLOCK, :].reshape(ids.shape[0], -1)
    if w.dim() == 3:  # fp32: [T, K]
        return w[ids // BLOCK, :, ids % BLOCK]
    return F.embedding(ids, w)
