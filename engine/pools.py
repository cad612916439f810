"""The request-to-token table and the token-granular KV pool, with their free-list allocators.

Invariants: request row 0 and KV slot 0 are never handed out; padded batch rows point at them, so their
writes land somewhere nobody reads. A row or slot is in exactly one of {free list, in use}: allocators
refuse a double free loudly instead of corrupting another request's cache.
"""
from __future__ import annotations

import torch

from engine.ops.kv_quant import row_elements
from engine.window_slots import WindowSlots


class ReqToTokenPool:
    """[size + 1, max_context] int32 map (request row, position) -> KV slot. Row 0 is the padding row."""

    def __init__(self, size: int, max_context: int) -> None:
        self.size, self.max_context = size, max_context
        self.table = torch.zeros(size + 1, max_context, dtype=torch.int32)
        self._free = list(range(size, 0, -1))  # pop() hands out the lowest row first
        self._in_use = [False] * (size + 1)

    def available_size(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        row = self._free.pop()
        self._in_use[row] = True
        return row

    def free(self, row: int) -> None:
        if row <= 0 or not self._in_use[row]:
            raise RuntimeError(f"request row {row} freed but not in use")
        self._in_use[row] = False
        self._free.append(row)


class KVPool:
    """Per-layer K and V buffers [num_slots + 1, kv_heads, head_dim] and the free-slot allocator.

    dtype torch.int8 / float8_e4m3fn is the int8 / fp8 cache (--kv-cache-dtype): rows of head_dim + 4 bytes, each
    row's fp32 scale in its last 4 (engine/ops/kv_quant.py), so the scales live in the same per-layer buffers and need
    no list of their own.

    One tensor per layer (not one for all layers): inductor then writes the new K/V in place instead of
    cloning a layer's slice of a shared buffer every step (docs/design.md §4).
    """

    def __init__(self, num_slots: int, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.num_slots, self.dtype = num_slots, dtype
        shape = (num_slots + 1, kv_heads, row_elements(head_dim, dtype))
        # empty(), not zeros(): zeros() writes every page, so a 5 GiB pool was 5 GiB resident from the start;
        # untouched pages of an empty() pool cost address space only. Every slot is written before it is read,
        # except through positions past a request's length that still map to slot 0 (the Python reference
        # attention reads those and masks them): slot 0 is zeroed so they hold finite values, never NaN (an int8
        # row of zeros is zeros with scale 0).
        self.k = [torch.empty(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype) for _ in range(num_layers)]
        for t in (*self.k, *self.v):
            t[0].zero_()
        self._free = torch.arange(1, num_slots + 1, dtype=torch.int64)
        self._in_use = torch.zeros(num_slots + 1, dtype=torch.bool)
        # The window layers' own slots (engine/window_slots.py): each allocated slot takes one, each freed slot gives
        # its one back. None: every layer's K/V is in the buffers above.
        self.window: WindowSlots | None = None

    @staticmethod
    def bytes_per_slot(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one token over `num_layers` layers, an int8 / fp8 cache's scales included."""
        return 2 * num_layers * kv_heads * row_elements(head_dim, dtype) * dtype.itemsize

    def available_size(self) -> int:
        return int(self._free.numel())

    def used_size(self) -> int:
        return self.num_slots - self.available_size()

    def free_slots(self) -> torch.Tensor:
        return self._free

    def check(self) -> None:
        """Raise if the in-use flags and the free list disagree on how many slots are taken."""
        assert int(self._in_use.sum()) == self.used_size(), "KV in-use flags and free list disagree"
        if self.window is not None:
            self.window.check(self._in_use)

    def allocate(self, n: int) -> torch.Tensor | None:
        """n distinct free slots (int64), each with a window slot when there are window layers, or None when fewer
        than n are free (nothing is taken then)."""
        if n > self._free.numel() or (self.window is not None and n > self.window.available_size()):
            return None
        out, self._free = self._free[:n], self._free[n:]
        self._in_use[out] = True
        if self.window is not None:
            self.window.attach(out)
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        if bool((slots <= 0).any()) or not bool(self._in_use[slots].all()) or slots.unique().numel() != slots.numel():
            raise RuntimeError("KV slots freed twice or never allocated")
        if self.window is not None:
            self.window.detach(slots)
        self._in_use[slots] = False
        self._free = torch.cat([self._free, slots.to(torch.int64)])


class WindowKVPool:
    """K/V of the sliding-window layers: a ring of `window + spare` slots per request row, one buffer per window layer.

    A window layer at position p sees positions (p - window, p] only, so a request never needs more than `window` of
    its K/V there: position p lives in ring entry p % ring of its row (ring = window + spare), and writing p
    overwrites p - ring, a position no later query sees. The spare entries are for speculative drafts: a verify step
    writes the K/V of a request's last token and its k drafts (positions p .. p + k) before any of them attends, and
    row p attends down to p - window + 1, so the writes must not wrap onto that: ring >= window + k. Row r owns slots
    (r - 1) * ring + 1 .. r * ring of every buffer, fixed for the row's life, so there is nothing to allocate or free:
    admission needs no window headroom, and a finished or retracted request's ring is simply overwritten by the row's
    next owner. Row 0 (padding) maps to slot 0. Attention is order-free once K carries its rope, so a ring read in
    entry order is as good as one in position order (engine/model/window.py).
    """

    def __init__(self, rows: int, window: int, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 spare: int = 0) -> None:
        self.rows, self.window = rows, window
        ring = self.ring = window + spare
        entries = torch.arange(ring, dtype=torch.int32)
        self.table = torch.zeros(rows + 1, ring, dtype=torch.int32)  # (row, position % ring) -> slot
        for r in range(1, rows + 1):
            self.table[r] = (r - 1) * ring + 1 + entries
        shape = (rows * ring + 1, kv_heads, row_elements(head_dim, dtype))  # (int8: as KVPool)
        # empty(), as KVPool: the ring entries a request has not written yet are never attended to (the reference
        # decode attention masks their values too), so their pages need not be touched before use.
        self.k = [torch.empty(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype) for _ in range(num_layers)]
        for t in (*self.k, *self.v):
            t[0].zero_()

    @staticmethod
    def bytes_for(rows: int, ring: int, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return (rows * ring + 1) * KVPool.bytes_per_slot(num_layers, kv_heads, head_dim, dtype)
