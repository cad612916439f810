"""Attention inputs of the sliding-window layers: the step's ForwardBatch re-aimed at their rings (engine/pools.py).

Decode needs no kernel of its own: with position p in ring entry p % window, the last min(p + 1, window) positions
are exactly ring entries 0 .. min(p + 1, window) - 1 of the row (in rotated order), and attention over them does not
depend on the order. So a window layer calls the same decode op with the ring table as its request-to-token table
and its lengths capped at the window; the compiled step derives those from its own inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch
from engine.ops.window_attention import window_prefill_attention


@dataclass(frozen=True)
class WindowPrefillMeta:
    """A prefill chunk as a window layer sees it."""

    ring_table: torch.Tensor
    req_rows: torch.Tensor
    prefix_lens: torch.Tensor
    prefill_lens: torch.Tensor
    window: int

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return window_prefill_attention(q, k, v, k_ring, v_ring, self.ring_table, self.req_rows, self.prefix_lens,
                                       self.prefill_lens, self.window, scale)


def window_meta(batch: ForwardBatch, ring_table: torch.Tensor, window: int) -> ForwardBatch | WindowPrefillMeta:
    if batch.is_decode:
        # Padded rows (row 0, position 0) land in slot 0, as in the full layers.
        assert batch.seq_lens is not None
        slots = ring_table[batch.req_rows, batch.positions % window].to(torch.int64)
        return ForwardBatch.decode(batch.input_ids, batch.positions, batch.req_rows, slots,
                                   batch.seq_lens.clamp(max=window), req_to_token=ring_table)
    return WindowPrefillMeta(ring_table, batch.req_rows, batch.prefix_lens, batch.prefill_lens, window)
