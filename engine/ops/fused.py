"""Whether the eager forward (prefill, and decode before its bucket is compiled) runs the fused C++ row ops
(engine/ops/csrc/elementwise/fused_rows.cpp: rms_norm, rope) in place of a handful of aten calls each.

A graph being compiled always takes the plain torch expressions: Inductor fuses those itself, and an opaque op in
the decode step would only stop it. So the model code asks `eager_fused()` at each call and keeps both forms.
"""
from __future__ import annotations

import torch

from engine.ops.native import NATIVE_OPS


def eager_fused() -> bool:
    return NATIVE_OPS and not torch.compiler.is_compiling()
