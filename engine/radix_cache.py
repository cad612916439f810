"""The prefix cache: a radix tree over token ids whose edges own KV-pool slots (SGLang's RadixAttention).

A finished request leaves its tokens' K/V here; a new request whose prompt starts with cached tokens maps
those slots into its request row and prefills only the rest. Matching is at token granularity: an edge is
split wherever two sequences diverge.

Ownership invariants (checked by `check` and by the tests after every engine step):
  - every slot is in exactly one of: the pool's free list, one tree node, one request's private range;
  - a node's `lock` counts the admitted requests whose matched prefix passes through it; a locked node is
    never evicted, and locking a node locks its whole path to the root (a prefix cannot outlive its parent);
  - `evictable_size` is the sum of unlocked nodes' slots, `protected_size` of locked ones.
Eviction frees least-recently-used unlocked leaves first; a parent becomes a leaf candidate once its last
child goes.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from engine.pools import KVPool


@dataclass(eq=False)
class TreeNode:
    key: list[int]  # the edge's tokens, from the parent to this node
    slots: torch.Tensor  # [len(key)] int64: where those tokens' K/V live
    parent: TreeNode | None = None
    children: dict[int, TreeNode] = field(default_factory=dict)  # keyed by the child's first token
    lock: int = 0
    last_used: int = 0  # a logical clock, not wall time, so eviction order is deterministic


def common_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists (slices compare in C, 64 tokens at a time)."""
    n = min(len(a), len(b))
    i = 0
    while i + 64 <= n and a[i : i + 64] == b[i : i + 64]:
        i += 64
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, kv: KVPool) -> None:
        self.kv = kv
        self.root = TreeNode(key=[], slots=torch.empty(0, dtype=torch.int64))
        self.root.lock = 1  # the root is never evicted
        self.evictable_size = 0
        self.protected_size = 0
        self._clock = 0

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---- lookup and insertion ---------------------------------------------------------------------
    def match(self, ids: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """The slots of the longest cached prefix of `ids` and the node where it ends (split there if the
        prefix ends inside an edge). The caller locks the node before it allocates anything."""
        node, pos, parts = self.root, 0, []
        now = self._tick()
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            common = common_len(child.key, ids[pos:])
            if common < len(child.key):
                child = self._split(child, common)
            child.last_used = now
            parts.append(child.slots)
            node, pos = child, pos + common
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return slots, node

    def insert(self, ids: list[int], slots: torch.Tensor) -> int:
        """Cache `ids` with their `slots`; returns how many leading tokens were already cached. The caller
        still owns `slots[:returned]` (duplicates of the tree's own) and must free the part it owned."""
        assert len(ids) == slots.numel()
        node, pos = self.root, 0
        now = self._tick()
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                leaf = TreeNode(key=list(ids[pos:]), slots=slots[pos:].clone(), parent=node, last_used=now)
                node.children[ids[pos]] = leaf
                self.evictable_size += len(leaf.key)
                return pos
            common = common_len(child.key, ids[pos:])
            if common < len(child.key):
                child = self._split(child, common)
            child.last_used = now
            node, pos = child, pos + common
        return pos

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut `child`'s edge after `at` tokens; returns the new upper node (same lock: same requests pass)."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key)
        upper = TreeNode(key=child.key[:at], slots=child.slots[:at], parent=parent, lock=child.lock,
                         last_used=child.last_used)
        upper.children[child.key[at]] = child
        parent.children[child.key[0]] = upper
        child.key, child.slots, child.parent = child.key[at:], child.slots[at:], upper
        return upper

    # ---- locking --------------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock > 0, "unlocking a node nobody locked"
            node.lock -= 1
            if node.lock == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent  # type: ignore[assignment]

    # ---- eviction ---------------------------------------------------------------------------------
    def evict(self, n: int) -> int:
        """Free at least `n` slots of unlocked leaves, least recently used first (fewer if not that many
        are evictable); returns the number freed."""
        heap = [(leaf.last_used, id(leaf), leaf) for leaf in self._leaves() if leaf.lock == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < n and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self.kv.free(leaf.slots)
            freed += len(leaf.key)
            self.evictable_size -= len(leaf.key)
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return freed

    def flush(self) -> int:
        """Evict everything no admitted request uses; returns the slots freed."""
        return self.evict(self.evictable_size)

    def _leaves(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    # ---- introspection (tests, metrics) ----------------------------------------------------------------
    def nodes(self) -> list[TreeNode]:
        """Every node but the root."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def all_slots(self) -> torch.Tensor:
        parts, stack = [], [self.root]
        while stack:
            node = stack.pop()
            parts.append(node.slots)
            stack.extend(node.children.values())
        return torch.cat(parts)

    def check(self) -> None:
        """Raise if the size counters, lock counts or edges are inconsistent."""
        evictable = protected = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                assert node.key and len(node.key) == node.slots.numel(), "edge and slots differ in length"
                assert node.parent is not None and node.parent.children.get(node.key[0]) is node
                assert node.lock >= sum(c.lock for c in node.children.values()), "child locked, parent not"
                if node.lock:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
            stack.extend(node.children.values())
        assert (evictable, protected) == (self.evictable_size, self.protected_size), "size counters drifted"
