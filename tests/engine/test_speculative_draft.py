"""Speculative decoding with a draft model (engine/draft_model.py): output equals speculation off token for token,
greedy and seeded, with batch mates, retraction, aborts, n > 1, stops and logprobs, for a draft that is the model
itself (every draft accepted: the catch-up and the K/V the draft keeps between rounds must be right) and for an
unrelated one (almost every draft rejected). The draft's pool is checked after every step (check_drafter).

As in test_speculative.py the planner's step cost is pinned (`_always_draft`) so every round drafts.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.sampling_params import SamplingParams
from engine.speculative import DraftPlanner
from scheduler_helpers import (Arrival, Driver, assert_idle_and_empty, assert_same_streams, run_checked,
                               tiny_engine)

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.3, top_p=0.9, top_k=40, repetition_penalty=1.05, logit_bias={7: 0.5}, seed=5,
                        max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def target(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def other(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("llama", seed=7)


def _engine(folder: Path, draft: Path | None, **overrides: Any) -> EngineCore:
    if draft is None:
        return tiny_engine(folder, **overrides)
    core = tiny_engine(folder, speculative="draft", draft_model=str(draft), **overrides)
    assert core.speculator is not None and core.speculator.drafter is not None
    core.speculator.planner.cost = lambda rows: 1.0 if rows <= 8 else None  # type: ignore[method-assign]
    return core


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 300) for _ in range(rng.randint(5, 40))] for _ in range(n)]


_run, _same = run_checked, assert_same_streams


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_self_draft_is_accepted_and_output_equals_speculation_off(target: Path, params: SamplingParams) -> None:
    prompts = _prompts(6)
    prompts.append(prompts[0][:12] + prompts[1])  # a prefix-cache hit: the draft still sees the whole prompt
    arrivals = [Arrival(i // 2, f"r{i}", p, params) for i, p in enumerate(prompts)]
    off = _run(_engine(target, None), arrivals)
    core = _engine(target, target)
    _same(off, _run(core, arrivals))
    stats = core.speculator.stats  # type: ignore[union-attr]
    # The draft computes the model's own logits: greedy drafts are all kept; sampled ones with the model's
    # probability of its argmax.
    if params is GREEDY:
        assert stats.proposed > 100 and stats.accepted >= 0.95 * stats.proposed
    else:
        assert stats.accepted > 20


def test_unrelated_draft_retraction_aborts_and_n_choices(target: Path, other: Path) -> None:
    """A pool too small for the batch (admission pinned reckless: requests are retracted and recomputed while they
    draft), an abort mid-run, n = 3 and mixed parameters; the draft is another random model, so nearly every draft
    is rejected and its slots are written again next round."""
    prompts = _prompts(6, seed=3)
    params = [GREEDY, SEEDED, SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=30),
              SamplingParams(temperature=0.0, min_tokens=20, max_tokens=30)]
    arrivals = [Arrival(i, f"r{i}", p, params[i % len(params)]) for i, p in enumerate(prompts)]
    aborts = {9: ["r4"]}
    off = Driver(_engine(target, None, max_total_tokens=150), pin_new_token_ratio=0.0).run(arrivals, aborts=aborts)
    for draft in (other, target):
        core = _engine(target, draft, max_total_tokens=150)
        on = Driver(core, pin_new_token_ratio=0.0).run(arrivals, aborts=aborts)
        assert_idle_and_empty(core)
        off_kept = {k: v for k, v in off.items() if k[0] != "r4"}
        _same(off_kept, {k: v for k, v in on.items() if k[0] != "r4"})
        assert on[("r4", 0)].finish_reason == "abort"
        assert core.scheduler.stats.retractions > 0
        assert core.speculator is not None and core.speculator.stats.proposed > 50


def test_stops_lengths_and_logprobs_as_without_speculation(target: Path) -> None:
    prompt = _prompts(1, seed=11)[0]
    core_off, core = _engine(target, None), _engine(target, target)
    probe = _run(core_off, [Arrival(0, "p", prompt, GREEDY)])[("p", 0)]
    text = core.tokenizer.decode(probe.token_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=40, stop=[stop], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, logprobs=True, top_logprobs=3, ignore_eos=True),
    ]
    arrivals = [Arrival(0, f"c{i}", prompt, p) for i, p in enumerate(cases)]
    off, on = _run(core_off, arrivals), _run(core, arrivals)
    _same(off, on)
    assert on[("c0", 0)].finish_reason == "stop" and len(on[("c1", 0)].token_ids) == 13
    for a, b in zip(off[("c2", 0)].logprobs, on[("c2", 0)].logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
    assert core.speculator is not None and core.speculator.stats.accepted > 20


def test_long_prompt_catch_up_and_a_small_draft_pool(target: Path) -> None:
    """Prompts longer than a prefill chunk reach the draft through its eager prefill; a target pool smaller than
    the prompts together makes the draft's pool evict the states of requests that are not drafting."""
    prompts = [p * 4 for p in _prompts(4, seed=5)]  # 20-160 tokens, chunked_prefill_size 16
    arrivals = [Arrival(0, f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    off = _run(_engine(target, None), arrivals)
    core = _engine(target, target, max_total_tokens=400)
    _same(off, _run(core, arrivals, pin_new_token_ratio=0.0))
    assert core.speculator is not None and core.speculator.stats.accepted > 50


def test_compiled_draft_and_target_buckets(target: Path) -> None:
    import torch._dynamo

    torch._dynamo.reset()
    arrivals = [Arrival(i, f"r{i}", p, GREEDY) for i, p in enumerate(_prompts(3, seed=8))]
    off = _run(_engine(target, None), arrivals)
    core = _engine(target, target, disable_compile=False, decode_buckets=(4, 8))
    _same(off, _run(core, arrivals))
    drafter = core.speculator.drafter  # type: ignore[union-attr]
    assert drafter is not None and set(drafter.runner.graphs.fns) == {4, 8}
    assert drafter.runner.graphs.steps_per_bucket.get(0, 0) == 0  # no eager draft step: every one was compiled


def test_planner_counts_the_drafts_cost() -> None:
    planner = DraftPlanner((1, 2, 4, 8), lambda b: True)
    planner.step_s.update({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})
    assert planner.plan([0.9], [5], budget=10) == [5]  # free drafts, free rows: all of them
    # Each draft token costs 0.6 of a step: 1 + .9 + .81 = 2.71 tokens in 2.2 s beats 1.9 in 1.6 s and 3.44 in 2.8 s.
    assert planner.plan([0.9], [5], budget=10, draft_cost=lambda longest: 0.6 * longest) == [2]
    assert planner.plan([0.5], [5], budget=10, draft_cost=lambda longest: 1.0 * longest) == [0]


def test_draft_mode_needs_a_model_with_the_same_tokenizer(target: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="go together"):
        EngineConfig(model=str(target), speculative="draft")
    with pytest.raises(ValueError, match="go together"):
        EngineConfig(model=str(target), draft_model=str(target))
    from transformers import AutoTokenizer

    import shutil

    foreign = tmp_path / "foreign"
    shutil.copytree(target, foreign)
    tok = AutoTokenizer.from_pretrained(foreign)
    tok.add_tokens(["<not-in-the-model's-vocabulary>"])
    tok.save_pretrained(foreign)
    with pytest.raises(ValueError, match="different tokenizer"):
        tiny_engine(target, speculative="draft", draft_model=str(foreign))
