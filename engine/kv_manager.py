"""Who owns which KV slot: the pool's free list, the prefix cache, or one request.

A request's row of the request-to-token table maps position i to a slot. Positions [0, cached_len) are
tree slots, shared and locked through `req.cache_node`; positions [cached_len, kv_len) are the request's own.
Releasing a request hands its own slots to the tree (or back to the pool when the cache is off or already
holds those tokens), so nothing is freed twice and nothing leaks: tree + requests + free == pool.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_disk import BLOCK_TOKENS, DiskKVStore
from engine.pools import KVPool, ReqToTokenPool
from engine.radix_cache import RadixCache, TreeNode
from engine.request import Request
from engine.window_keeper import WindowKeeper


@dataclass
class CacheStats:
    queried_tokens: int = 0  # tokens admitted requests needed in the cache
    hit_tokens: int = 0  # of which were found there
    evicted_tokens: int = 0  # cache entries dropped to make room

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVManager:
    def __init__(self, kv: KVPool, req_pool: ReqToTokenPool, prefix_cache: bool,
                 disk: DiskKVStore | None = None, window: int = 0) -> None:
        """window: the sliding window of the layers whose K/V live in `kv.window` (engine/window_slots.py)."""
        self.kv, self.req_pool = kv, req_pool
        self.cache = RadixCache(kv) if prefix_cache else None
        self.disk = disk if prefix_cache else None  # the prefix cache's disk tier (engine/kv_disk.py)
        self.windows = WindowKeeper(kv.window, window, req_pool) if kv.window is not None else None
        self.stats = CacheStats()

    # ---- sizes ----------------------------------------------------------------------------------------
    def headroom(self) -> int:
        """Slots an allocation can get: free ones plus cached ones nobody holds (evicted on demand)."""
        return self.kv.available_size() + (self.cache.evictable_size if self.cache else 0)

    def held_slots(self) -> int:
        """Slots admitted requests hold (their own and locked tree ones): the pool's real load."""
        return self.kv.num_slots - self.headroom()

    def cached_slots(self) -> int:
        return self.cache.total_size if self.cache else 0

    def allocate(self, n: int) -> torch.Tensor | None:
        """n slots, evicting unused cache entries if the free list is short (and taking unpinned cached positions'
        window slots if those are short); None when even that is not enough."""
        short = n - self.kv.available_size()
        if short > 0 and self.cache is not None:
            self.stats.evicted_tokens += self.cache.evict(short)
        if self.windows is not None and self.cache is not None:
            short = n - self.windows.slots.available_size()
            if short > 0:
                self.windows.reclaim(self.cache, short)
        return self.kv.allocate(n)

    def sync_windows(self, admitted: list[Request]) -> None:
        """Before a step's allocations: window slots of positions out of the admitted requests' windows go back."""
        if self.windows is not None:
            self.windows.sync(admitted)

    # ---- a request's life -------------------------------------------------------------------------------
    def match(self, req: Request) -> int:
        """Map the longest cached prefix of the request's tokens into its (fresh) row and lock it; returns its
        length. At least one token is always left to compute: the next token's logits come from it. A mean-pooled
        embedding needs every token's hidden state, so it reuses nothing (it still holds the tree's root, as every
        admitted request holds a node)."""
        req.cached_len, req.cache_node = 0, None
        if self.cache is None:
            return 0
        reuse = req.pooling != "mean"
        ids = req.all_ids[: req.fill_len - 1] if reuse else []
        slots, node = self.cache.match(ids)
        if self.disk is not None and reuse:
            slots, node = self._load_from_disk(ids, slots, node)
        if self.windows is not None and slots.numel():
            resume = self.windows.resume_len(slots)
            if resume < slots.numel():  # the window before the match's end was trimmed: resume earlier
                slots, node = self.cache.match(ids[:resume])
        self.cache.lock(node)
        req.cache_node, req.cached_len = node, slots.numel()
        self.req_pool.table[req.req_row, : req.cached_len] = slots.to(torch.int32)
        if self.windows is not None:
            self.windows.admitted(req)
        if reuse:
            self.stats.queried_tokens += req.fill_len
            self.stats.hit_tokens += req.cached_len
        return req.cached_len

    def _load_from_disk(self, ids: list[int], slots: torch.Tensor, node: TreeNode) -> tuple[torch.Tensor, TreeNode]:
        """Extend the tree's match of `ids` with the blocks the disk tier has past it: they are read into fresh
        slots and inserted into the tree (so later requests find them there), then matched again."""
        assert self.cache is not None and self.disk is not None
        self.cache.lock(node)  # the allocations below may evict: never the prefix just matched
        covered, loaded = self.disk.load(ids, slots.numel(), self.allocate)
        self.cache.unlock(node)
        if not loaded.numel():
            return slots, node
        had = self.cache.insert(ids[:covered], torch.cat([slots, loaded]))
        assert had == slots.numel()  # the tree's own slots up to the match; the loaded ones are the tree's now
        return self.cache.match(ids)

    def unmatch(self, req: Request) -> None:
        """Undo `match` for a request that is not admitted after all."""
        if self.windows is not None and req.req_row:
            self.windows.released(req)
        if self.cache is not None and req.cache_node is not None:
            self.cache.unlock(req.cache_node)
            if req.pooling != "mean":
                self.stats.queried_tokens -= req.fill_len
                self.stats.hit_tokens -= req.cached_len
        req.cache_node, req.cached_len = None, 0

    def publish(self, req: Request) -> None:
        """Put the request's computed tokens in the tree now (mid-prefill), so requests admitted later share
        them; its own slots that duplicate cached ones are swapped for the tree's and freed."""
        if self.cache is None or req.kv_len <= req.cached_len:
            return
        ids = self._insert(req)
        row = self.req_pool.table[req.req_row]
        slots, node = self.cache.match(ids)
        assert slots.numel() == req.kv_len
        if self.disk is not None:
            self.disk.save(ids, slots)
        row[req.cached_len : req.kv_len] = slots[req.cached_len :].to(torch.int32)
        self.cache.lock(node)
        assert req.cache_node is not None
        self.cache.unlock(req.cache_node)
        req.cache_node, req.cached_len = node, req.kv_len

    def release(self, req: Request) -> None:
        """Give back the request's row; its computed K/V stay cached for later requests (idempotent: a
        released request holds row 0)."""
        if not req.req_row:
            return
        if self.windows is not None:
            self.windows.sync([req])  # (its last step moved its window on)
            self.windows.released(req)
        if self.cache is None:
            self.kv.free(self.req_pool.table[req.req_row, req.cached_len : req.kv_len].to(torch.int64))
        else:
            ids = self._insert(req)
            if self.disk is not None and len(ids) >= BLOCK_TOKENS:
                self.disk.save(ids, self.cache.match(ids)[0])
            assert req.cache_node is not None
            self.cache.unlock(req.cache_node)
        self.req_pool.free(req.req_row)
        req.req_row, req.kv_len, req.cached_len, req.cache_node = 0, 0, 0, None

    def _insert(self, req: Request) -> list[int]:
        """Cache the request's computed tokens; its own slots for tokens the tree already held go back to the
        pool (the tree keeps its copy; the row still points at them until the caller remaps or frees it).
        Returns the inserted ids."""
        assert self.cache is not None
        row = self.req_pool.table[req.req_row]
        ids = req.all_ids[: req.kv_len]
        had = self.cache.insert(ids, row[: req.kv_len].to(torch.int64))
        own = row[req.cached_len : had].to(torch.int64)  # had >= cached_len: that prefix is locked
        if self.windows is not None and own.numel():
            # The tree's copy of these positions may have given its window K/V back while this request still reads
            # them: it takes this request's instead (same tokens, same positions).
            self.windows.slots.adopt(self.cache.match(ids[:had])[0][req.cached_len :], own)
        self.kv.free(own)
        return ids

    def flush(self) -> int:
        """Drop every prefix-cache entry nobody holds, and the disk tier's blocks; returns the pool slots freed."""
        if self.disk is not None:
            self.disk.flush()
        return self.cache.flush() if self.cache else 0

    # ---- checks (tests) ---------------------------------------------------------------------------------
    def check(self, admitted: list[Request]) -> None:
        """Raise unless every slot is owned exactly once: free list, tree, or one admitted request."""
        self.kv.check()
        parts = [self.kv.free_slots()]
        if self.cache is not None:
            self.cache.check()
            parts.append(self.cache.all_slots())
        for r in admitted:
            parts.append(self.req_pool.table[r.req_row, r.cached_len : r.kv_len].to(torch.int64))
            if self.cache is None:
                assert r.cached_len == 0 and r.cache_node is None
        owned = torch.cat(parts).sort().values
        assert torch.equal(owned, torch.arange(1, self.kv.num_slots + 1)), "a KV slot is owned twice or lost"
        if self.windows is not None:
            self.windows.check(admitted)
