"""The window layers' own slots with the prefix cache on (engine/window_slots.py, engine/window_keeper.py).

The tiny Gemma 3 (window 8) runs with a window pool at its floor (every admitted request's window plus one step), so
requests give their out-of-window slots back every step, the prefix cache's slots are reclaimed over and over, and
cached prefixes are resumed only where their window survived. Every step the accounting is checked (each window
slot owned once, every admitted request's window present, pins exact); greedy output must equal the rings' (the
prefix cache off), which keep exactly the last window per request.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.model_runner import window_slot_count, window_slot_floor
from engine.sampling_params import SamplingParams
from engine.window_slots import WindowSlots, resumable_len
from engine_helpers import random_prompts
from scheduler_helpers import Arrival, Driver, assert_idle_and_empty, tiny_engine
from tiny_gemma3 import WINDOW, hf_gemma3, hf_logits, write_tiny_gemma3

TIGHT = dict(max_running_requests=2, decode_buckets=(1, 2), chunked_prefill_size=16, window_kv_ratio=0.01)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "gemma3-window")


def test_resumable_len() -> None:
    def at(present: str, window: int = 4) -> int:
        return resumable_len(torch.tensor([c == "1" for c in present], dtype=torch.bool), window)

    assert at("") == 0
    assert at("111111") == 6
    assert at("000111") == 6  # the 3 positions before 6 are there
    assert at("111011") == 3  # before 6 only two: position 3 is gone, so at 3 at the latest (0..2 all there)
    assert at("001011") == 0  # ... and here not even that
    assert at("110111") == 6
    assert at("10111") == 5
    assert at("1101") == 2  # short prefixes need every position
    assert at("0111", window=8) == 0


def test_window_slots_follow_the_pool_and_check_their_accounting() -> None:
    ws = WindowSlots(4, 11, 1, 1, 4, torch.float32)
    in_use = torch.zeros(11, dtype=torch.bool)
    a = torch.tensor([3, 7, 9])
    ws.attach(a)
    in_use[a] = True
    ws.check(in_use)
    assert ws.available_size() == 1 and bool(ws.present(a).all())
    assert ws.detach(torch.tensor([7])) == 1 and ws.detach(torch.tensor([7])) == 0  # trimmed: nothing to give back
    ws.check(in_use)
    b = torch.tensor([5])
    ws.attach(b)
    in_use[b] = True
    ws.adopt(torch.tensor([7]), b)  # 7 takes 5's window slot (5 is then freed by its pool)
    assert ws.present(torch.tensor([7, 5])).tolist() == [True, False]
    ws.check(in_use)
    in_use[3] = False  # a pool slot freed without its window slot
    with pytest.raises(AssertionError, match="free token-pool slot"):
        ws.check(in_use)


def test_the_window_pool_is_sized_from_the_ratio_with_a_floor(gemma3: Path) -> None:
    core = tiny_engine(gemma3, max_total_tokens=1000, max_running_requests=4, window_kv_ratio=0.5)
    ws = core.runner.kv_pool.window
    assert ws is not None and ws.num_slots == 500 and ws.k[0].shape[0] == 501
    assert len(ws.k) == 4 and len(core.runner.kv_pool.k) == 2  # four window layers, two full ones
    assert core.runner.k_caches[0] is ws.k[0] and core.runner.k_caches[2] is core.runner.kv_pool.k[0]
    assert ws.map.shape[0] == 4 * core.runner.max_context + 1  # fixed by the flags, not the pool
    floor = window_slot_floor(core.config, WINDOW)
    assert floor == 4 * (WINDOW - 1) + 16 + 1
    assert window_slot_count(dataclasses.replace(core.config, window_kv_ratio=0.001), WINDOW, 1000) == floor
    assert window_slot_count(core.config, WINDOW, 40) == 40  # never more than the pool's slots
    # The map has a fixed shape, so the pool stops at max running requests x max context (1024 here).
    assert tiny_engine(gemma3, max_total_tokens=4000, max_running_requests=4).runner.kv_pool.num_slots == 1024
    assert tiny_engine(gemma3, max_total_tokens=1000, disable_prefix_cache=True).runner.kv_pool.window is None


def _workload(vocab: int) -> list[Arrival]:
    prompts = random_prompts([40, 30, 23, 50, 12, 45, 33, 20], vocab, seed=3)
    prompts[3] = prompts[0][:35] + prompts[3][35:]  # resumes inside request 0's prompt
    prompts[5] = prompts[1][:30] + prompts[5][30:]  # request 1's whole prompt, then more
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    two = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, n=2)
    return [Arrival(3 * i, f"r{i}", p, two if i == 6 else greedy) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("retract", [False, True], ids=["admission", "reckless-retraction"])
def test_greedy_output_equals_the_rings_with_the_window_pool_at_its_floor(gemma3: Path, retract: bool) -> None:
    hf = hf_gemma3(gemma3)
    arrivals = _workload(hf.config.vocab_size)
    pool = dict(max_total_tokens=90 if retract else 600)
    core = tiny_engine(gemma3, **TIGHT, **pool)
    ws = core.runner.kv_pool.window
    assert ws is not None and ws.num_slots == window_slot_floor(core.config, WINDOW)
    driver = Driver(core, pin_new_token_ratio=0.0 if retract else None)
    got = driver.run(arrivals, aborts={25: ["r7"]})
    assert_idle_and_empty(core)
    rings = Driver(tiny_engine(gemma3, **TIGHT, **pool, disable_prefix_cache=True)).run(
        [a for a in arrivals if a.request_id != "r7"])
    for key, stream in rings.items():
        assert got[key].token_ids == stream.token_ids, key
    prompt = arrivals[2].prompt
    assert got[("r2", 0)].token_ids == hf_logits(hf, prompt + got[("r2", 0)].token_ids[:-1],
                                                 len(prompt)).argmax(-1).tolist()
    keeper = core.scheduler.kvm.windows
    assert keeper is not None and keeper.trimmed_own > 0 and keeper.reclaimed > 0
    assert core.scheduler.kvm.stats.hit_tokens > 0
    if retract:
        assert core.scheduler.stats.retractions > 0


def test_a_finished_request_is_resumed_at_its_end_and_its_dead_window_is_gone(gemma3: Path) -> None:
    """Multi-turn: the next turn repeats the whole conversation. Its decoded positions gave their window slots back
    as it went, except the last window - 1, which is exactly what resuming at its end needs."""
    hf = hf_gemma3(gemma3)
    core = tiny_engine(gemma3, **{**TIGHT, "window_kv_ratio": 0.5}, max_total_tokens=600)  # room: nothing reclaimed
    kvm = core.scheduler.kvm
    prompt = random_prompts([30], hf.config.vocab_size, seed=11)[0]
    params = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    first = Driver(core).run([Arrival(0, "a", prompt, params)])[("a", 0)].token_ids
    seq = prompt + first
    slots, _ = kvm.cache.match(seq[:-1])  # what the tree holds of it (the last token has no K/V yet)
    assert slots.numel() == len(seq) - 1
    present = core.runner.kv_pool.window.present(slots)
    assert bool(present[: len(prompt)].all())  # the prompt was cached as it was prefilled: still resumable
    assert not bool(present[len(prompt) : -(WINDOW - 1)].any())  # decoded positions out of the window: gone
    assert bool(present[-(WINDOW - 1) :].all())
    turn2 = seq + random_prompts([6], hf.config.vocab_size, seed=12)[0]
    before = kvm.stats.hit_tokens
    second = Driver(core).run([Arrival(0, "b", turn2, params)])[("b", 0)].token_ids
    assert kvm.stats.hit_tokens - before == len(seq) - 1
    assert second == hf_logits(hf, turn2 + second[:-1], len(turn2)).argmax(-1).tolist()
    assert_idle_and_empty(core)


def test_the_disk_tier_keeps_which_positions_lost_their_window(gemma3: Path, tmp_path: Path) -> None:
    """A finished request's blocks go to disk with its decoded positions' window K/V already given back; after a
    restart they load without it (never as zeros someone reads) and the next turn resumes where the window is whole
    (its prompt's end here), computing what rings compute."""
    hf = hf_gemma3(gemma3)
    settings = dict(TIGHT, window_kv_ratio=0.5, max_total_tokens=600)
    prompt = random_prompts([70], hf.config.vocab_size, seed=21)[0]
    params = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    first = tiny_engine(gemma3, **settings, compile_cache_dir=str(tmp_path), kv_disk_cache_size=64)
    answer = Driver(first).run([Arrival(0, "a", prompt, params)])[("a", 0)].token_ids
    first.close()
    turn2 = prompt + answer + random_prompts([5], hf.config.vocab_size, seed=22)[0]
    again = tiny_engine(gemma3, **settings, compile_cache_dir=str(tmp_path), kv_disk_cache_size=64)
    got = Driver(again).run([Arrival(0, "b", turn2, params)])[("b", 0)].token_ids
    assert_idle_and_empty(again)
    disk = again.kvm.disk
    assert disk is not None and disk.stats.hit_blocks == 2  # positions 0..127, 70..127 without window K/V
    assert again.kvm.stats.hit_tokens == len(prompt)  # resumed at the prompt's end, the last whole window
    rings = tiny_engine(gemma3, **settings, disable_prefix_cache=True)
    assert got == Driver(rings).run([Arrival(0, "b", turn2, params)])[("b", 0)].token_ids
    again.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_aborts_at_random_steps_leak_no_window_slot(gemma3: Path, seed: int) -> None:
    """Requests aborted at random steps (prefilling, decoding, waiting) while the window pool is at its floor: the
    accounting holds after every step and abort, and the requests left run to what the rings compute."""
    rng = torch.Generator().manual_seed(seed)
    arrivals = _workload(300)
    victims = [a.request_id for a in arrivals if int(torch.randint(0, 3, (1,), generator=rng)) == 0]
    aborts: dict[int, list[str]] = {}
    for rid in victims:
        aborts.setdefault(int(torch.randint(0, 60, (1,), generator=rng)), []).append(rid)
    core = tiny_engine(gemma3, **TIGHT, max_total_tokens=200)
    got = Driver(core).run(arrivals, aborts=aborts)
    assert_idle_and_empty(core)
    assert core.runner.kv_pool.window.used_size() <= core.scheduler.kvm.cached_slots()
    kept = [a for a in arrivals if a.request_id not in victims]
    want = Driver(tiny_engine(gemma3, **TIGHT, max_total_tokens=200, disable_prefix_cache=True)).run(kept)
    for key, stream in want.items():
        assert got[key].token_ids == stream.token_ids, key
