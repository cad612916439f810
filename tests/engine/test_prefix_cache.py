"""The prefix cache: the radix tree on its own, then whole engines on a tiny random model.

The oracle is the same workload with the cache off: greedy and seeded outputs must be equal token for token,
with shared prefixes, repeats, n > 1, aborts and a pool small enough to force eviction and retraction. After
every engine step `check_accounting` proves each KV slot is owned exactly once (free, tree, or one request).
"""
from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.pools import KVPool
from engine.radix_cache import RadixCache
from engine.sampling_params import SamplingParams
from scheduler_helpers import Arrival, Driver, Stream, assert_idle_and_empty, run_solo, tiny_engine

MakeTinyModel = Callable[..., Path]


def _pool(n: int = 64) -> KVPool:
    return KVPool(num_slots=n, num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32)


def _cache_tokens(cache: RadixCache, pool: KVPool, ids: list[int]) -> torch.Tensor:
    """What a finished request does: allocate slots for `ids`, insert, free the duplicates."""
    slots = pool.allocate(len(ids))
    assert slots is not None
    had = cache.insert(ids, slots)
    pool.free(slots[:had])
    return slots


# ---- the tree on its own ------------------------------------------------------------------------------
def test_match_splits_edges_at_token_granularity() -> None:
    pool = _pool()
    cache = RadixCache(pool)
    a = _cache_tokens(cache, pool, [1, 2, 3, 4, 5])
    assert cache.insert([1, 2, 3, 4, 5], a) == 5  # all of it is there already
    slots, node = cache.match([1, 2, 3, 9])
    assert slots.tolist() == a[:3].tolist() and node.key == [1, 2, 3]  # the edge was split after 3 tokens
    b = _cache_tokens(cache, pool, [1, 2, 3, 7, 8])
    slots, _ = cache.match([1, 2, 3, 7, 8, 6])
    assert slots.tolist() == a[:3].tolist() + b[3:].tolist()
    assert cache.match([9])[0].numel() == 0
    cache.check()
    assert cache.total_size == 7 == pool.used_size()


def test_locked_prefixes_survive_eviction_and_lru_goes_first() -> None:
    pool = _pool(16)
    cache = RadixCache(pool)
    _cache_tokens(cache, pool, [1, 2, 3, 4])  # oldest
    _cache_tokens(cache, pool, [5, 6, 7, 8])
    _cache_tokens(cache, pool, [9, 10, 11, 12])
    cache.match([1, 2, 3, 4])  # touched: now the most recently used
    _, node = cache.match([5, 6])
    cache.lock(node)  # a running request holds [5, 6] (and only that part of its edge)
    assert (cache.protected_size, cache.evictable_size) == (2, 10)
    # Whole leaves, least recently used first: [7, 8] (untouched since its insert), then [9..12].
    assert cache.evict(3) == 6
    assert cache.match([9])[0].numel() == 0 and cache.match([5, 6, 7])[0].numel() == 2
    assert cache.match([1, 2, 3, 4])[0].numel() == 4
    assert cache.flush() == 4  # [1..4]; the locked [5, 6] stays
    assert cache.match([5, 6, 7])[0].numel() == 2 and pool.used_size() == 2
    cache.unlock(node)
    cache.check()
    assert cache.flush() == 2 and pool.used_size() == 0 and cache.total_size == 0


# ---- engines ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(make_tiny_model: MakeTinyModel) -> Path:
    return make_tiny_model("llama")


def shared_prefix_workload(seed: int) -> tuple[list[Arrival], dict[int, list[str]]]:
    """Prompts built from three system prefixes (longer than a prefill chunk) plus random turns; some exact
    repeats, some extensions of earlier prompts, some n > 1; greedy and seeded sampling; a few aborts."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 320) for _ in range(n)] for n in (20, 37, 50)]
    arrivals: list[Arrival] = []
    for i in range(28):
        kind = rng.random()
        if arrivals and kind < 0.2:
            prompt = list(rng.choice(arrivals).prompt)  # a repeat
        elif arrivals and kind < 0.4:
            prompt = rng.choice(arrivals).prompt + [rng.randrange(3, 320) for _ in range(rng.randint(1, 12))]
        else:
            prompt = rng.choice(systems) + [rng.randrange(3, 320) for _ in range(rng.randint(1, 20))]
        n = 3 if i % 7 == 3 else 1
        if i % 4 == 1:
            params = SamplingParams(temperature=1.0, top_p=0.9, seed=rng.randrange(1000), n=n,
                                    max_tokens=rng.randint(1, 30), ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.0, n=n, max_tokens=rng.randint(1, 30), ignore_eos=i % 2 == 0)
        arrivals.append(Arrival(rng.randint(0, 60), f"r{i}", prompt, params))
    aborts = {rng.randint(5, 80): [f"r{rng.randrange(28)}"] for _ in range(4)}
    return arrivals, aborts


def _completed(streams: dict[tuple[str, int], Stream]) -> dict[tuple[str, int], tuple[list[int], str | None]]:
    return {k: (s.token_ids, s.finish_reason) for k, s in streams.items() if s.finish_reason != "abort"}


@pytest.mark.parametrize("seed", [11, 12])
def test_cache_on_equals_cache_off(folder: Path, seed: int) -> None:
    arrivals, aborts = shared_prefix_workload(seed)
    off = tiny_engine(folder, disable_prefix_cache=True)
    expected = _completed(Driver(off).run(arrivals, aborts=aborts))
    assert off.scheduler.kvm.stats.hit_tokens == 0 and off.scheduler.kvm.cached_slots() == 0
    assert_idle_and_empty(off)
    assert off.runner.kv_pool.available_size() == off.runner.kv_pool.num_slots

    on = tiny_engine(folder)
    got = _completed(Driver(on).run(arrivals, aborts=aborts))
    common = expected.keys() & got.keys()  # an abort may land before or after a request finished
    assert len(common) > 0.8 * len(expected)
    assert {k: got[k] for k in common} == {k: expected[k] for k in common}
    stats = on.scheduler.kvm.stats
    assert stats.hit_tokens > 0.3 * stats.queried_tokens, stats
    assert on.scheduler.stats.prompt_tokens < off.scheduler.stats.prompt_tokens
    assert_idle_and_empty(on)


@pytest.mark.parametrize("pinned_ratio", [None, 0.0], ids=["default-reserve", "no-reserve"])
def test_small_pool_evicts_then_retracts_and_outputs_hold(folder: Path, pinned_ratio: float | None) -> None:
    arrivals, aborts = shared_prefix_workload(5)
    off = tiny_engine(folder, disable_prefix_cache=True)
    expected = _completed(Driver(off).run(arrivals, aborts=aborts))
    on = tiny_engine(folder, max_total_tokens=220)
    got = _completed(Driver(on, pin_new_token_ratio=pinned_ratio).run(arrivals, aborts=aborts))
    common = expected.keys() & got.keys()
    assert len(common) > 0.8 * len(expected)
    assert {k: got[k] for k in common} == {k: expected[k] for k in common}
    assert on.scheduler.kvm.stats.evicted_tokens > 0 and on.scheduler.kvm.stats.hit_tokens > 0
    if pinned_ratio == 0.0:  # reckless admission: the pool ran dry with the cache already emptied
        assert on.scheduler.stats.retractions > 0
    assert_idle_and_empty(on)


def test_repeated_prompt_reports_cached_tokens_and_flush_empties(folder: Path) -> None:
    core = tiny_engine(folder)
    prompt = list(range(5, 45))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = run_solo(core, prompt, greedy)
    before = core.scheduler.stats.prompt_tokens
    outs = []
    core.add(core.make_requests("again", prompt, greedy))
    while core.has_work():
        outs += core.step()
    assert [t for o in outs for t in o.token_ids] == first.token_ids
    assert {o.cached_tokens for o in outs} == {len(prompt) - 1}  # one token is always computed for its logits
    assert core.scheduler.stats.prompt_tokens - before == 1
    # Output tokens are cached too: the next turn of the conversation reuses them (all but the last one).
    core.add(core.make_requests("turn2", prompt + first.token_ids + [7, 8], greedy))
    outs = []
    while core.has_work():
        outs += core.step()
    assert outs[-1].cached_tokens == len(prompt) + len(first.token_ids) - 1
    used = core.runner.kv_pool.used_size()
    assert used == core.scheduler.kvm.cached_slots() > len(prompt)
    assert core.scheduler.flush_cache() == used
    assert core.scheduler.kvm.cached_slots() == 0 and core.runner.kv_pool.used_size() == 0


def test_n_choices_and_simultaneous_requests_share_one_prefill(folder: Path) -> None:
    core = tiny_engine(folder)
    prompt = list(range(10, 70))  # 60 tokens: four chunks of 16
    sampled = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=6, ignore_eos=True)
    other = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    driver = Driver(core)
    driver.add("fan", prompt, sampled)
    driver.add("same-system", prompt[:50] + [3, 4, 5], other)
    driver.run()
    # The prompt was computed once; every later sharer computed only what it did not share.
    assert core.scheduler.stats.prompt_tokens == len(prompt) + 3 * 1 + 3
    solo = tiny_engine(folder, disable_prefix_cache=True)
    expected = Driver(solo)
    expected.add("fan", prompt, sampled)
    expected.add("same-system", prompt[:50] + [3, 4, 5], other)
    assert _completed(expected.run()) == _completed(driver.streams)
    assert_idle_and_empty(core)
