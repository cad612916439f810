"""The KV slot and request-row allocators under random alloc/free sequences."""
from __future__ import annotations

import random

import pytest
import torch

from engine.pools import KVPool, ReqToTokenPool


def test_kv_allocator_never_double_allocates_and_recovers_everything() -> None:
    pool = KVPool(num_slots=500, num_layers=1, kv_heads=1, head_dim=4, dtype=torch.float32)
    rng = random.Random(0)
    held: list[torch.Tensor] = []
    for _ in range(2000):
        if held and rng.random() < 0.45:
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            got = pool.allocate(rng.randint(1, 40))
            if got is None:
                continue
            held.append(got)
        in_use = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
        assert in_use.unique().numel() == in_use.numel(), "a slot was handed out twice"
        assert bool((in_use > 0).all()), "slot 0 is reserved for padding"
        assert pool.available_size() + in_use.numel() == 500
    for slots in held:
        pool.free(slots)
    assert pool.available_size() == 500
    assert sorted(pool.allocate(500).tolist()) == list(range(1, 501))


def test_kv_allocate_all_or_nothing_and_double_free_refused() -> None:
    pool = KVPool(num_slots=10, num_layers=2, kv_heads=1, head_dim=2, dtype=torch.float32)
    a = pool.allocate(8)
    assert pool.allocate(3) is None and pool.available_size() == 2
    pool.free(a[:4])
    with pytest.raises(RuntimeError):
        pool.free(a[:1])
    with pytest.raises(RuntimeError):
        pool.free(torch.tensor([0]))
    assert pool.available_size() == 6


def test_req_rows() -> None:
    pool = ReqToTokenPool(size=3, max_context=16)
    rows = [pool.allocate() for _ in range(3)]
    assert sorted(rows) == [1, 2, 3] and pool.allocate() is None
    pool.free(rows[1])
    with pytest.raises(RuntimeError):
        pool.free(rows[1])
    assert pool.allocate() == rows[1]
    assert pool.table.shape == (4, 16) and int(pool.table[0].abs().sum()) == 0
