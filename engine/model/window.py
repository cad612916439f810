"""Attention inputs of the sliding-window layers: the step's ForwardBatch re-aimed at their rings (engine/pools.py).

Decode needs no kernel of its own: with position p in ring entry p % window, the last min(p + 1, window) positions
are exactly ring entries 0 .. min(p + 1, window) - 1 of the row (in rotated order), and attention over them does not
depend on the order. So a window layer calls the same decode op with the ring table as its request-to-token table
and its lengths capped at the window; the compiled step derives those from its own inputs. Rings with spare entries
for drafts (longer than the window) are read through a [B, window] table of each row's last positions instead, as
the window layers in the token pool are.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch
from engine.ops.window_attention import window_pool_prefill_attention, window_prefill_attention


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
    if not batch.is_decode:
        return WindowPrefillMeta(ring_table, batch.req_rows, batch.prefix_lens, batch.prefill_lens, window)
    # Padded rows (row 0, position 0) land in slot 0, as in the full layers.
    assert batch.seq_lens is not None
    ring = ring_table.shape[1]
    slots = ring_table[batch.req_rows, batch.positions % ring].to(torch.int64)
    if ring == window:
        return ForwardBatch.decode(batch.input_ids, batch.positions, batch.req_rows, slots,
                                   batch.seq_lens.clamp(max=window), req_to_token=ring_table)
    # Spare entries (drafts): row p reads the entries of positions p - window + 1 .. p, which differ mod ring.
    table = ring_table[batch.req_rows[:, None], _window_positions(batch.positions, window) % ring]
    return _decode_through(batch, table, slots, window)


def _window_positions(positions: torch.Tensor, window: int) -> torch.Tensor:
    """[B, window]: positions p - window + 1 .. p of each decode row at p (from 0 while p < window - 1: the columns
    past p are then not read, the lengths being capped at p + 1)."""
    first = (positions - (window - 1)).clamp(min=0)
    return first[:, None] + torch.arange(window, device=positions.device)[None, :]


def _decode_through(batch: ForwardBatch, table: torch.Tensor, out_slots: torch.Tensor, window: int) -> ForwardBatch:
    """A window layer's decode batch over a [B, window] table gathered per row: row i reads table[i] up to its
    length, capped at the window."""
    assert batch.seq_lens is not None
    rows = torch.arange(batch.positions.shape[0], device=batch.positions.device)
    return ForwardBatch.decode(batch.input_ids, batch.positions, rows, out_slots, batch.seq_lens.clamp(max=window),
                               req_to_token=table)


@dataclass(frozen=True)
class WindowPoolPrefillMeta:
    """A prefill chunk as a window layer sees it when its K/V live in the token pool (the prefix cache on)."""

    batch: ForwardBatch
    window: int
    slot_map: torch.Tensor | None  # token-pool slot -> window slot (engine/window_slots.py); None: the same slots

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        scale: float
    ) -> torch.Tensor:
        b = self.batch
        assert b.req_to_token is not None and b.prefix_lens is not None and b.prefill_lens is not None
        return window_pool_prefill_attention(q, k, v, k_cache, v_cache, b.out_slots, b.req_to_token, b.req_rows,
                                             b.prefix_lens, b.prefill_lens, self.window, scale, self.slot_map)


def pool_window_meta(batch: ForwardBatch, window: int,
                     slot_map: torch.Tensor | None = None) -> ForwardBatch | WindowPoolPrefillMeta:
    """Window layers over per-position slots: a decode row attends to the last min(p + 1, window) positions of its
    request, through a [B, window] table gathered from its request-to-token row (entries past its length are not
    read), with the same decode op as every layer. Every position keeps its own slot here, so a cached prefix holds
    what its window layers need, and drafts never overwrite what an earlier row reads. slot_map: the window layers'
    own slot of each token-pool slot (engine/window_slots.py); the positions a row reads always have one."""
    if not batch.is_decode:
        return WindowPoolPrefillMeta(batch, window, slot_map)
    assert batch.req_to_token is not None
    columns = _window_positions(batch.positions, window).clamp(max=batch.req_to_token.shape[1] - 1)
    table = batch.req_to_token[batch.req_rows[:, None], columns]  # [B, window] int32
    out_slots = batch.out_slots
    if slot_map is not None:
        table, out_slots = slot_map[table], slot_map[out_slots].to(torch.int64)
    return _decode_through(batch, table, out_slots, window)
