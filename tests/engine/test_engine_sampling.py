"""Sampling through the whole engine: per-request seeds whatever the batch, n > 1 choices, and logprobs
against transformers' own logits."""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.core import EngineCore
from engine.sampling_params import SamplingParams
from engine_helpers import hf_model
from scheduler_helpers import Arrival, Driver, run_solo, tiny_engine


@pytest.fixture(scope="module")
def folder(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("qwen2")


@pytest.fixture(scope="module")
def core(folder: Path) -> EngineCore:
    return tiny_engine(folder)


def prompts(n: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(3, 40))] for _ in range(n)]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=42, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.02, repetition_penalty=1.2,
                   presence_penalty=0.5, seed=7, max_tokens=24, ignore_eos=True),
], ids=["plain", "truncated-penalised"])
def test_seed_reproducible_across_batch_compositions(core: EngineCore, params: SamplingParams) -> None:
    prompt, *others = prompts(7)
    alone = run_solo(core, prompt, params).token_ids
    assert run_solo(core, prompt, params).token_ids == alone
    # A different seed gives a different sequence, so the comparisons below can fail.
    assert params.seed is not None
    assert run_solo(core, prompt, replace(params, seed=params.seed + 1)).token_ids != alone
    mates = [SamplingParams(temperature=0.0, max_tokens=30), SamplingParams(temperature=1.0, max_tokens=20),
             SamplingParams(temperature=0.7, seed=3, max_tokens=10), SamplingParams(temperature=1.0, top_k=5, n=2,
                                                                                     max_tokens=12)]
    busy = [Arrival(0, f"m{i}", p, mates[i % len(mates)]) for i, p in enumerate(others)]
    # First into the batch (row 0), or joining it mid-decode in a later row.
    for arrivals in ([Arrival(0, "seeded", prompt, params), *busy], [*busy, Arrival(3, "seeded", prompt, params)]):
        streams = Driver(core).run(arrivals)
        assert streams[("seeded", 0)].token_ids == alone


def test_n_choices(core: EngineCore) -> None:
    [prompt] = prompts(1, seed=9)
    params = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=12, ignore_eos=True)
    driver = Driver(core)
    streams = driver.run([Arrival(0, "n3", prompt, params), Arrival(1, "other", prompt[:5], params)])
    choices = [streams[("n3", i)] for i in range(3)]
    assert set(streams) == {("n3", i) for i in range(3)} | {("other", i) for i in range(3)}
    for c in choices:
        assert (c.finish_reason, len(c.token_ids), c.prompt_tokens) == ("length", 12, len(prompt))
    assert len({tuple(c.token_ids) for c in choices}) == 3  # seeded per choice, so they differ
    again = Driver(core).run([Arrival(0, "n3", prompt, params)])
    assert [again[("n3", i)].token_ids for i in range(3)] == [c.token_ids for c in choices]
    greedy = Driver(core).run([Arrival(0, "g", prompt, SamplingParams(temperature=0.0, n=3, max_tokens=8))])
    solo = run_solo(core, prompt, SamplingParams(temperature=0.0, max_tokens=8))
    assert all(greedy[("g", i)].token_ids == solo.token_ids for i in range(3))


def test_logprobs_match_transformers(core: EngineCore, folder: Path) -> None:
    """Without penalties, reported logprobs are log_softmax of the raw logits (before temperature)."""
    hf = hf_model(folder)
    p1, p2, p3 = prompts(3, seed=13)
    lp_greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=4)
    lp_sampled = SamplingParams(temperature=1.3, seed=2, max_tokens=6, ignore_eos=True, logprobs=True)
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)  # shares the batch, asks for none
    streams = Driver(core).run([Arrival(0, "g", p1, lp_greedy), Arrival(0, "s", p2, lp_sampled),
                                Arrival(1, "plain", p3, plain)])
    assert streams[("plain", 0)].logprobs == []
    for rid, prompt, top in (("g", p1, 4), ("s", p2, 0)):
        got = streams[(rid, 0)]
        assert len(got.logprobs) == 6
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + got.token_ids])).logits[0]
        ref = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # the distribution each token came from
        for k, (tok, lp) in enumerate(zip(got.token_ids, got.logprobs)):
            assert lp.logprob == pytest.approx(float(ref[k, tok]), abs=1e-4)
            assert len(lp.top) == top
            if top:
                best = ref[k].topk(top)
                assert [t for t, _ in lp.top] == best.indices.tolist()
                assert [v for _, v in lp.top] == pytest.approx(best.values.tolist(), abs=1e-4)
                assert lp.top[0][0] == tok  # greedy takes the best
