"""The sliding-window layers' own slots when the prefix cache is on (SGLang's SWA-aware pool, in Ember's terms).

A window layer at position p reads positions (p - window, p] only, so its K/V of older positions is dead for the
request that wrote them: keeping it for every cached token (as the full layers must) would cost a Gemma 3 about five
sixths of its KV memory for nothing. So the window layers get a smaller pool of their own:

- Every token-pool slot s may own one window slot, `map[s]` (0 = none). A token-pool allocation takes a window slot
  for each of its slots, a token-pool free gives the window slots back (engine/pools.py KVPool), so window ownership
  follows the token pool's (free list, prefix cache, one request) without a second ownership graph.
- A slot whose window slot was given back early is *trimmed*: its full layers' K/V stay valid (they are all a later
  request needs of a position older than its window), its window layers' are gone. engine/kv_manager.py trims a
  running request's own positions once they fall out of its window, trims the prefix cache's positions when the
  window pool runs short (least recently used nodes first, unpinned positions only), and resumes a cached prefix only
  where the `window - 1` positions before the resume point still have theirs.
- `pins[s]` counts the admitted requests whose window still reads slot s of the prefix cache; a pinned slot is never
  trimmed.

The window layers read their buffers through `map` (engine/model/window.py): decode gathers map[req_to_token[...]],
so the compiled steps need nothing else. `map` has an entry for every slot a pool of this request table can have
(max_running_requests x max_context, fixed by the flags), so its shape never depends on the memory free at start.
"""
from __future__ import annotations

import torch

from engine.ops.kv_quant import row_elements


class WindowSlots:
    def __init__(self, num_slots: int, map_size: int, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        """num_slots window slots (slot 0 is the padding slot, as in KVPool) for map entries 0 .. map_size - 1."""
        self.num_slots = num_slots
        shape = (num_slots + 1, kv_heads, row_elements(head_dim, dtype))
        self.k = [torch.empty(shape, dtype=dtype) for _ in range(num_layers)]  # (empty(): see KVPool)
        self.v = [torch.empty(shape, dtype=dtype) for _ in range(num_layers)]
        for t in (*self.k, *self.v):
            t[0].zero_()
        self.map = torch.zeros(map_size, dtype=torch.int32)  # token-pool slot -> window slot; 0 = none
        self.pins = torch.zeros(map_size, dtype=torch.int32)
        self._free = torch.arange(1, num_slots + 1, dtype=torch.int64)

    def available_size(self) -> int:
        return int(self._free.numel())

    def used_size(self) -> int:
        return self.num_slots - self.available_size()

    def attach(self, slots: torch.Tensor) -> None:
        """Give each of the (fresh) token-pool `slots` a window slot; the caller made sure enough are free."""
        n = slots.numel()
        assert n <= self._free.numel(), "window slots attached beyond the free ones"
        self.map[slots], self._free = self._free[:n].to(torch.int32), self._free[n:]

    def detach(self, slots: torch.Tensor) -> int:
        """Give back the window slots of those `slots` that have one (trimmed ones have none); returns how many."""
        if slots.numel() == 0:
            return 0
        owned = self.map[slots].to(torch.int64)
        has = owned != 0
        if not bool(has.any()):
            return 0
        self.map[slots[has]] = 0
        self._free = torch.cat([self._free, owned[has]])
        return int(has.sum())

    def adopt(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Move the window slots of `source` to the trimmed `target` slots at the same positions (a request's own
        copy of tokens the prefix cache also holds, about to be freed: the cache's copy keeps its window K/V)."""
        move = (self.map[target] == 0) & (self.map[source] != 0)
        if bool(move.any()):
            self.map[target[move]] = self.map[source[move]]
            self.map[source[move]] = 0

    def present(self, slots: torch.Tensor) -> torch.Tensor:
        """[n] bool: which slots still have their window layers' K/V."""
        return self.map[slots] != 0

    def pin(self, slots: torch.Tensor, by: int) -> None:
        """Add `by` (+1 or -1) to the pins of `slots` (distinct slots: a request's row maps each position once)."""
        if slots.numel():
            self.pins[slots] += by

    def check(self, in_use: torch.Tensor) -> None:
        """Raise unless each window slot is free or owned by exactly one in-use token-pool slot (`in_use`: the
        token pool's [num_slots + 1] flags), and no pin count is negative."""
        mapped = self.map.nonzero().flatten()
        assert bool(in_use[mapped].all()), "a free token-pool slot still owns a window slot"
        owned = torch.cat([self._free, self.map[mapped].to(torch.int64)]).sort().values
        assert torch.equal(owned, torch.arange(1, self.num_slots + 1)), "a window slot is owned twice or lost"
        assert int(self.pins.min()) >= 0, "a window pin went negative"


def resumable_len(present: torch.Tensor, window: int) -> int:
    """The longest prefix length P <= len(present) a request can resume at: every one of the window - 1 positions
    before P (all of them when P < window) still has its window layers' K/V."""
    end = present.numel()
    missing = (~present).nonzero().flatten().tolist()
    while missing and end - 1 - missing[-1] < window - 1:
        end = missing.pop()  # the window before `end` reaches a trimmed position: resume at it at the latest
        while missing and missing[-1] >= end:
            missing.pop()
    return end
