"""Fake kernels for `ember::linear_bf16` ([..., K] x packed [N_pad/32, K/2, 32, 2] -> [..., n]) and `ember::linear_f32`
([..., K] x packed [N_pad/32, K, 32] -> [..., n])."""
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
