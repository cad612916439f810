"""Whether the eager forward (prefill, and decode before its bucket is compiled) runs the fused C++ row ops
(engine/ops/csrc/elementwise/fused_rows.cpp: rms_norm, rope, silu_mul) in place of a handful of aten calls each.

A graph being compiled always takes the plain torch expressions: Inductor fuses those itself, and an opaque op in
the decode step would only stop it. So the model code asks `eager_fused()` at each call and keeps both forms.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.ops.native import NATIVE_OPS


def eager_fused() -> bool:
    return NATIVE_OPS and not torch.compiler.is_compiling()


@functools.cache
def _silu_table() -> torch.Tensor:
    """torch's bf16 silu of every bf16 value, by bit pattern (and a zero entry after, see silu_mul.h): ember::silu_mul
    looks its silu values up here, so they are torch's to the bit."""
    values = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return torch.cat([F.silu(values).view(torch.int16), torch.zeros(1, dtype=torch.int16)])


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused gate|up projection's output [T, 2 I] (gate first): one C++ pass in bf16 eager
    (the same rounding as torch's two ops), the torch expression otherwise."""
    if eager_fused() and gate_up.dtype == torch.bfloat16 and gate_up.is_contiguous():
        return torch.ops.ember.silu_mul(gate_up, _silu_table())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
