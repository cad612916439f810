"""Fake kernels for `ember::linear_gguf` ([..., K] x an interleaved GGUF weight of n rows -> [..., n], the input's
dtype; `linear_gguf_f32`: float32) and `ember::gguf_rows` (ids -> [*ids.shape, K] in the requested dtype),
engine/quant/gguf_blocks.py."""
from __future__ import annotations

import torch

import engine.ops.native  # noqa: F401  (builds and registers the ops the fakes attach to)
from engine.ops.native import NATIVE_OPS
from engine.quant.gguf_blocks import GGUF_TYPES, group_rows

if NATIVE_OPS:

    def _k(packed: torch.Tensor, qtype: int) -> int:
        _, values, size = GGUF_TYPES[int(qtype)]
        return packed.shape[1] // group_rows(qtype) // size * values

    @torch.library.register_fake("ember::linear_gguf")
    def _linear_gguf_fake(x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("ember::linear_gguf_f32")
    def _linear_gguf_f32_fake(x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], n), dtype=torch.float32)

    @torch.library.register_fake("ember::linear_gguf_isa")
    def _linear_gguf_isa_fake(x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int, isa: str) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("ember::gguf_rows")
    def _gguf_rows_fake(packed: torch.Tensor, ids: torch.Tensor, qtype: int, n: int,
                        dtype: torch.dtype) -> torch.Tensor:
        return packed.new_empty((*ids.shape, _k(packed, qtype)), dtype=dtype)
