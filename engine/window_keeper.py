"""When the window layers' slots (engine/window_slots.py) are given back: the policy side, for engine/kv_manager.py.

- A request's own positions give theirs back once they fall out of its window (`sync`, before every step's
  allocations): position p is dead for a request whose next query is at kv_len once p < kv_len - window + 1, and
  kv_len only grows while the request holds its row (rejected drafts are freed outright; retraction releases all).
- The prefix cache's positions still in an admitted request's window are pinned; the others keep their window K/V
  until the window pool runs short (`reclaim`), least recently used nodes first, a node's oldest positions first
  (its end is where a later request most likely resumes).
- A cached prefix is resumed only where the window - 1 positions before the resume point have theirs
  (`resumable_len`); the full layers' K/V of the positions before are all it needs of them.

Bound: an admitted request holds at most window - 1 window slots (own or pinned) between steps, and a step allocates
at most max(chunked_prefill_size, the largest decode bucket) more, so a window pool of
max_running_requests x (window - 1) + that many slots never runs out once the cache's unpinned ones are reclaimed
(engine/model_runner.py sizes it at least so).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.pools import ReqToTokenPool
from engine.radix_cache import RadixCache
from engine.request import Request
from engine.window_slots import WindowSlots, resumable_len


class WindowKeeper:
    def __init__(self, slots: WindowSlots, window: int, req_pool: ReqToTokenPool) -> None:
        self.slots, self.window, self.req_pool = slots, window, req_pool
        self.trimmed_own = 0  # window slots given back by requests whose window moved on
        self.reclaimed = 0  # taken from the prefix cache because the window pool ran short

    def resume_len(self, slots: torch.Tensor) -> int:
        """How much of a matched prefix (its slots) a request can resume from."""
        return resumable_len(self.slots.present(slots), self.window)

    def _live_start(self, req: Request) -> int:
        return max(0, req.kv_len - self.window + 1)

    def _repin(self, req: Request, start: int, end: int) -> None:
        row = self.req_pool.table[req.req_row]
        old = req.window_pinned
        if old == (start, end):
            return
        self.slots.pin(row[old[0] : old[1]].to(torch.int64), -1)
        self.slots.pin(row[start:end].to(torch.int64), +1)
        req.window_pinned = (start, end)

    def admitted(self, req: Request) -> None:
        """A request matched `cached_len` cached positions into its row: pin the ones its window reads."""
        req.window_from = req.cached_len
        req.window_pinned = (0, 0)
        self._repin(req, max(0, req.cached_len - self.window + 1), req.cached_len)

    def sync(self, reqs: Iterable[Request]) -> None:
        """Give back the window slots of the requests' own positions out of their window; re-pin their cached ones."""
        for req in reqs:
            if not req.req_row:
                continue
            live = self._live_start(req)
            start = max(req.window_from, req.cached_len)
            if live > start:
                row = self.req_pool.table[req.req_row]
                self.trimmed_own += self.slots.detach(row[start:live].to(torch.int64))
                req.window_from = live
            self._repin(req, min(live, req.cached_len), req.cached_len)

    def released(self, req: Request) -> None:
        self._repin(req, 0, 0)
        req.window_from = 0

    def reclaim(self, cache: RadixCache, n: int) -> int:
        """Give back at least `n` window slots of unpinned cached positions (fewer if not that many); returns how
        many. Takes at least 1/32 of the pool at once: a short pool stays short step after step, and each call walks
        the whole tree."""
        n = max(n, self.slots.num_slots // 32)
        got = 0
        for node in sorted(cache.nodes(), key=lambda nd: nd.last_used):
            if got >= n:
                break
            slots = node.slots
            free = slots[self.slots.present(slots) & (self.slots.pins[slots] == 0)]
            got += self.slots.detach(free[: n - got])
        self.reclaimed += got
        return got

    def check(self, admitted: list[Request]) -> None:
        """Raise unless every admitted request's window positions have their window slots and the pins are exactly
        the admitted requests' pinned ranges."""
        pins = torch.zeros_like(self.slots.pins)
        for r in admitted:
            row = self.req_pool.table[r.req_row]
            live = row[self._live_start(r) : r.kv_len].to(torch.int64)
            assert bool(self.slots.present(live).all()), f"request {r.request_id}: a window position lost its K/V"
            start, end = r.window_pinned
            assert end <= r.cached_len, "pinned past the cached prefix"
            pins[row[start:end].to(torch.int64)] += 1
        assert torch.equal(pins, self.slots.pins), "window pins drifted"
