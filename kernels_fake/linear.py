"""Fake kernels for `ember::linear_bf16` ([..., K] x packed [N_pad/32, K/2, 32, 2] -> [..., n]), `ember::linear_f32`
([..., K] x packed [N_pad/32, K, 32] -> [..., n]) and `ember::linear_q` ([..., K] x a packed quantized weight of n
rows -> [..., n], engine/quant/format.py)."""
from __future__ import annotations

import torch

import engine.ops.native  # noqa: F401  (builds and registers the op the fake attaches to)
from engine.ops.native import NATIVE_OPS

if NATIVE_OPS:  # the op exists wherever the extension is built (it refuses tiers without a kernel)

    @torch.library.register_fake("ember::linear_bf16")
    def _linear_bf16_fake(x: torch.Tensor, w_packed: torch.Tensor, n: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("ember::linear_f32")
    def _linear_f32_fake(x: torch.Tensor, w_packed: torch.Tensor, n: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("ember::linear_q")
    def _linear_q_fake(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                       n: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], n))
