"""Continuous batching on a tiny random model: requests arriving at any step, chunked prefill, retraction and
aborts must never change what a request generates (greedy, or seeded sampling) and must never leak a KV slot.

The oracle for each request is the same request run alone on an idle engine.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch._dynamo

from engine.core import EngineCore
from engine.sampling_params import SamplingParams
from scheduler_helpers import Arrival, Driver, Stream, assert_idle_and_empty, run_solo, tiny_engine

CHUNK = 16
MakeTinyModel = Callable[..., Path]
Workload = tuple[list[Arrival], dict[str, Stream]]  # arrivals, and each request's solo run


def mixed_workload(n: int = 24, seed: int = 1234) -> list[Arrival]:
    """Random prompt lengths (a third longer than one prefill chunk), max_tokens and arrival steps; mostly
    greedy, every fourth request seeded sampling (which must be batch-independent too)."""
    rng = random.Random(seed)
    arrivals = []
    for i in range(n):
        length = rng.randint(CHUNK + 1, 60) if i % 3 == 0 else rng.randint(1, CHUNK)
        prompt = [rng.randrange(3, 320) for _ in range(length)]
        if i % 4 == 3:
            params = SamplingParams(temperature=1.0, top_p=0.9, seed=rng.randrange(1000), max_tokens=rng.randint(1, 40))
        else:
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 40), ignore_eos=i % 2 == 0)
        arrivals.append(Arrival(rng.randint(0, 40), f"r{i}", prompt, params))
    return arrivals


def assert_same_as_solo(streams: dict[tuple[str, int], Stream], solos: dict[str, Stream]) -> None:
    for rid, solo in solos.items():
        got = streams[(rid, 0)]
        assert got.token_ids == solo.token_ids, rid
        assert got.text == solo.text, rid
        assert (got.finish_reason, got.stop_reason) == (solo.finish_reason, solo.stop_reason), rid


@pytest.fixture(scope="module")
def folder(make_tiny_model: MakeTinyModel) -> Path:
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def eager(folder: Path) -> EngineCore:
    return tiny_engine(folder)


@pytest.fixture(scope="module")
def workload(eager: EngineCore) -> Workload:
    arrivals = mixed_workload()
    return arrivals, {a.request_id: run_solo(eager, a.prompt, a.params) for a in arrivals}


def test_mixed_arrivals_equal_solo_runs(eager: EngineCore, workload: Workload) -> None:
    arrivals, solos = workload
    before, hits_before = eager.scheduler.stats.prompt_tokens, eager.scheduler.kvm.stats.hit_tokens
    driver = Driver(eager)
    assert_same_as_solo(driver.run(arrivals), solos)
    assert_idle_and_empty(eager)
    # The workload really batched: prompts were prefilled while others decoded, and nothing was recomputed:
    # each prompt token was computed once or found in the prefix cache (the solo runs left them there).
    assert driver.mixed_steps > 10
    assert eager.scheduler.stats.retractions == 0
    computed = eager.scheduler.stats.prompt_tokens - before
    hits = eager.scheduler.kvm.stats.hit_tokens - hits_before
    assert computed + hits == sum(len(a.prompt) for a in arrivals) and hits > 0
    assert any(len(a.prompt) > CHUNK for a in arrivals)


@pytest.mark.slow
def test_mixed_arrivals_compiled_buckets(folder: Path, workload: Workload) -> None:
    """The same workload through compiled decode graphs (buckets 1, 2, 4, 8): same tokens, no recompiles."""
    arrivals, solos = workload
    core = tiny_engine(folder, disable_compile=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        streams = Driver(core).run(arrivals)
    assert_same_as_solo(streams, solos)
    assert_idle_and_empty(core)
    used = {b for b, n in core.runner.graphs.steps_per_bucket.items() if n}
    assert used == {1, 2, 4, 8}, core.runner.graphs.steps_per_bucket


@pytest.mark.parametrize("pinned_ratio", [None, 0.0], ids=["default-reserve", "no-reserve"])
def test_retraction_when_kv_runs_dry(folder: Path, eager: EngineCore, pinned_ratio: float | None) -> None:
    """A pool far too small for everyone's full output: requests are retracted and recomputed, and their
    outputs (greedy and seeded) are exactly the uninterrupted ones."""
    rng = random.Random(7)
    arrivals = []
    for i in range(10):
        prompt = [rng.randrange(3, 320) for _ in range(rng.randint(5, 40))]
        sampled = i % 3 == 2
        params = SamplingParams(temperature=1.0 if sampled else 0.0, seed=i if sampled else None,
                                max_tokens=rng.randint(30, 60), ignore_eos=True)
        arrivals.append(Arrival(i // 4, f"q{i}", prompt, params))
    solos = {a.request_id: run_solo(eager, a.prompt, a.params) for a in arrivals}
    core = tiny_engine(folder, max_total_tokens=160)
    streams = Driver(core, pin_new_token_ratio=pinned_ratio).run(arrivals)
    assert_same_as_solo(streams, solos)
    stats = core.scheduler.stats
    assert stats.retractions > (5 if pinned_ratio == 0.0 else 0)
    # Retracted work was recomputed (or found in the prefix cache), generated tokens included (more than one
    # chunk of them).
    assert stats.prompt_tokens + core.scheduler.kvm.stats.hit_tokens > sum(len(a.prompt) for a in arrivals) + CHUNK
    for a in arrivals:
        st = streams[(a.request_id, 0)]
        assert (st.finish_reason, len(st.token_ids)) == ("length", a.params.max_tokens)
    assert_idle_and_empty(core)


def test_abort_in_queue_in_prefill_and_mid_decode_frees_everything(folder: Path, eager: EngineCore) -> None:
    core = tiny_engine(folder, max_running_requests=3)
    kvm, rows = core.scheduler.kvm, core.runner.req_pool  # held slots: an aborted request's K/V stay cached, unheld
    rng = random.Random(3)
    prompts = {rid: [rng.randrange(3, 320) for _ in range(n)] for rid, n in
               [("keep", 12), ("decoding", 10), ("long", 3 * CHUNK + 5), ("queued", 8), ("pair", 6)]}
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    driver = Driver(core)
    for rid in ("keep", "decoding", "long", "queued"):
        driver.add(rid, prompts[rid], greedy)
    driver.add("pair", prompts["pair"], SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=30, ignore_eos=True))
    driver.step()  # one prefill: keep, decoding and the first chunk of long are admitted (3 rows)

    # From the queue: it never held anything.
    held = kvm.held_slots()
    [out] = driver.abort("queued")
    assert (out.finish_reason, out.token_ids, out.completion_tokens) == ("abort", (), 0)
    assert kvm.held_slots() == held and rows.available_size() == 0

    # Mid chunked prefill: its finished chunks are freed at once.
    while not any(r.request_id == "long" and 0 < r.kv_len < len(prompts["long"]) for r in core.scheduler.prefilling):
        driver.step()
    long_req = next(r for r in core.scheduler.prefilling if r.request_id == "long")
    held, cached = kvm.held_slots(), long_req.kv_len
    [out] = driver.abort("long")
    assert out.finish_reason == "abort"
    assert kvm.held_slots() == held - cached and rows.available_size() == 1

    # Mid decode, once it has generated a few tokens.
    while len(driver.streams[("decoding", 0)].token_ids) < 5:
        driver.step()
    dec = next(r for r in core.scheduler.running if r.request_id == "decoding")
    held, cached = kvm.held_slots(), dec.kv_len
    assert cached >= len(prompts["decoding"]) + 4
    [out] = driver.abort("decoding")
    assert out.finish_reason == "abort" and driver.streams[("decoding", 0)].finish_reason == "abort"
    assert kvm.held_slots() == held - cached

    # Both choices of an n=2 request, once they are decoding.
    while not any(r.request_id == "pair" and r.output_ids for r in core.scheduler.running):
        driver.step()
    outs = driver.abort("pair")
    assert sorted(o.index for o in outs) == [0, 1] and {o.finish_reason for o in outs} == {"abort"}
    assert kvm.held_slots() == core.scheduler.running[0].kv_len  # only "keep" is left
    assert core.abort("pair") == [] and core.abort("no-such-request") == []

    driver.run()
    assert driver.streams[("keep", 0)].token_ids == run_solo(eager, prompts["keep"], greedy).token_ids
    assert core.scheduler.stats.aborted == 5  # queued, long, decoding, pair/0, pair/1
    assert_idle_and_empty(core)


def test_prompts_arriving_together_get_first_tokens_one_after_another(folder: Path, eager: EngineCore) -> None:
    """A prefill batch takes no further prompt once it holds PREFILL_BATCH_TOKENS: three 150-token prompts that
    fit one 512-token chunk still run one per forward, so the first has its first token after one prefill."""
    core = tiny_engine(folder, chunked_prefill_size=512)
    rng = random.Random(9)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = {f"p{i}": [rng.randrange(3, 320) for _ in range(150)] for i in range(3)}
    driver = Driver(core)
    for rid, prompt in prompts.items():
        driver.add(rid, prompt, greedy)
    driver.step()
    assert [len(driver.streams[(rid, 0)].token_ids) for rid in prompts] == [1, 0, 0]
    driver.run()
    for rid, prompt in prompts.items():
        assert driver.streams[(rid, 0)].token_ids == run_solo(eager, prompt, greedy).token_ids
    assert_idle_and_empty(core)
