"""Attention inputs of the sliding-window layers: the step's AttentionMeta re-aimed at their rings (engine/pools.py).

Decode needs no kernel of its own: with position p in ring entry p % window, the last min(p + 1, window) positions
are exactly ring entries 0 .. min(p + 1, window) - 1 of the row (in rotated order), and attention over them does not
depend on the order. So a window layer calls the same decode op with the ring table as its request-to-token table
and its lengths capped at the window; the compiled step derives those from its own inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.attention_meta import AttentionMeta, DecodeMeta
from engine.ops.window_attention import window_extend_attention


@dataclass(frozen=True)
class WindowExtendMeta:
    """A prefill chunk as a window layer sees it."""

    ring_table: torch.Tensor
    req_rows: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    window: int

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return window_extend_attention(q, k, v, k_ring, v_ring, self.ring_table, self.req_rows, self.prefix_lens,
                                       self.extend_lens, self.window, scale)


def window_meta(meta: AttentionMeta, positions: torch.Tensor, ring_table: torch.Tensor,
                window: int) -> DecodeMeta | WindowExtendMeta:
    if isinstance(meta, DecodeMeta):
        # Padded rows (row 0, position 0) land in slot 0, as in the full layers.
        slots = ring_table[meta.req_rows, positions % window].to(torch.int64)
        return DecodeMeta(out_slots=slots, req_to_token=ring_table, req_rows=meta.req_rows,
                          seq_lens=meta.seq_lens.clamp(max=window))
    return WindowExtendMeta(ring_table, meta.req_rows, meta.prefix_lens, meta.extend_lens, window)
