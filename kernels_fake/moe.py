"""Fake kernel for `ember::moe_experts` (engine/ops/moe.py): the routed experts' summed output has x's shape."""
from __future__ import annotations

from typing import Optional

import torch

import engine.ops.moe  # noqa: F401  (defines the op the fake attaches to)


@torch.library.register_fake("ember::moe_experts")
def _moe_experts_fake(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
                      gate_up_scales: Optional[torch.Tensor], gate_up_mins: Optional[torch.Tensor],
                      down: torch.Tensor, down_scales: Optional[torch.Tensor], down_mins: Optional[torch.Tensor],
                      inter: int, gate_up_qtype: int = 0, down_qtype: int = 0) -> torch.Tensor:
    return torch.empty_like(x)
