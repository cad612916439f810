"""Speculative decoding (n-gram drafts verified as extra decode rows): the drafter and planner on their own, then
whole engines whose output with speculation must equal speculation off token for token, greedy and seeded, with
batch mates, retraction, the prefix cache, n > 1, stops, logprobs and grammar-constrained mates. Slot accounting
is checked after every step (scheduler_helpers.Driver).

The planner drafts only when measured step times say it pays, which on a shared machine is not deterministic, so
the engine tests pin its step cost to a constant (`_always_draft`): then every proposal is verified, and each test
asserts that drafts were accepted, so equality is not vacuous.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from engine.core import EngineCore
from engine.sampling_params import SamplingParams
from engine.speculative import (CLASS_PRIORS, MATCH_CLASSES, RATE_RECOVERY, STEP_SAMPLES, DraftPlanner, NgramIndex,
                                SpecState, Speculator, match_class)
from scheduler_helpers import Arrival, assert_same_streams, run_checked, tiny_engine


# ---- the drafter ------------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    idx = NgramIndex()
    ids = [1, 2, 3, 9, 9, 5, 2, 3, 7, 8, 4, 2, 3]
    # [2, 3] occurred twice before; the latest one (at 6) was followed by 7, 8, 4
    assert idx.propose(ids, 3) == [7, 8, 4]
    assert NgramIndex().propose([5, 6, 7, 1, 2, 3, 9, 6, 7], 2) == [1, 2]
    assert NgramIndex().propose([1, 2, 3, 4], 3) == []  # no earlier occurrence of any suffix 2-gram
    # A longer suffix match wins over a more recent shorter one: [1, 2, 3] at 0 beats [2, 3] at 5.
    assert NgramIndex().propose([1, 2, 3, 4, 6, 2, 3, 5, 1, 2, 3], 2) == [4, 6]


def test_a_source_that_runs_into_the_end_goes_on_around_the_loop() -> None:
    # The latest [8, 9] is 3 tokens back: the text repeats with period 3, and the proposal follows the repeat
    # past the end of what was there.
    assert NgramIndex().propose([1, 7, 8, 9, 7, 8, 9], 7) == [7, 8, 9, 7, 8, 9, 7]
    assert NgramIndex().propose([1, 7, 8, 9, 7, 8, 9], 2) == [7, 8]


def test_match_classes_tell_a_copy_in_progress_from_a_fresh_short_match() -> None:
    text = list(range(100, 120))
    idx = NgramIndex()
    assert idx.propose([5, 6, 1, 2, 50, 60, 1, 2], 2) == [50, 60]
    assert idx.matched == 2 and match_class(idx.matched) == 0
    copy = [*text, 0, *text[:12]]  # the text quoted again: its last 12 tokens match
    assert idx.propose(copy, 3) == text[12:15]
    assert idx.matched == MATCH_CLASSES[-1] and match_class(idx.matched) == len(MATCH_CLASSES) - 1
    assert [match_class(m) for m in range(MATCH_CLASSES[-1] + 2)] == sorted(
        match_class(m) for m in range(MATCH_CLASSES[-1] + 2))  # classes rise with the matched length


def test_ngram_follows_its_thread_while_the_text_keeps_matching() -> None:
    # [1, 2, 3, 4] occurs twice in the text; a copy of the first occurrence must go on with 5, not the latest's 6.
    text = [7, 1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6]
    idx = NgramIndex()
    ids = [*text, 99, 7, 1]
    assert idx.propose(ids, 2) == [2, 3]
    ids += [2, 3, 4]  # two drafts accepted, and the model's own next token still follows the thread
    assert idx.propose(ids, 2) == [5, 9]
    assert NgramIndex().propose(ids, 2) == [6, 99]  # a fresh lookup takes the latest occurrence
    ids += [0, 0]  # the thread is broken and no suffix 2-gram occurred before
    assert idx.propose(ids, 2) == []


# ---- the planner ------------------------------------------------------------------------------------------
def _planner(costs: dict[int, float], ready: Callable[[int], bool] = lambda b: True) -> DraftPlanner:
    planner = DraftPlanner((1, 2, 4, 8), ready)
    planner.step_s.update(costs)
    return planner


def test_planner_drafts_as_far_as_it_pays() -> None:
    flat = _planner({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})  # extra rows are free: draft everything proposed
    assert flat.plan([0.5], [5], budget=10) == [5]
    assert flat.plan([0.5], [5], budget=3) == [3]  # no more rows than the pool's headroom
    assert flat.plan([0.5, 0.5], [8, 8], budget=99) == [3, 3]  # at most the largest bucket's 8 rows
    steep = _planner({1: 1.0, 2: 1.9, 4: 3.9, 8: 8.0})  # each row costs as much as a whole step: never pays
    assert steep.plan([0.9], [7], budget=10) == [0]
    mid = _planner({1: 1.0, 2: 1.2, 4: 1.5, 8: 3.0})
    assert mid.plan([0.9], [7], budget=10) == [3]  # 1 + .9 + .81 + .73 = 3.44 tokens in 1.5 s beats 8 rows
    assert mid.plan([0.1], [7], budget=10) == [0]  # 1.1 tokens in 1.2 s is less than 1 in 1 s


def test_planner_uses_free_padding_rows_and_skips_unready_buckets() -> None:
    # 3 requests fill bucket 4 with one padding row: that row is a free draft for the likeliest request.
    planner = _planner({4: 1.0, 8: 2.5})
    assert planner.plan([0.2, 0.8, 0.3], [4, 4, 4], budget=10) == [0, 1, 0]
    unready = _planner({1: 1.0}, ready=lambda b: b == 1)
    assert unready.plan([0.9], [5], budget=10) == [0]
    # An unmeasured ready bucket is tried at the cost of the largest measured one below it.
    assert _planner({1: 1.0}).plan([0.9], [1], budget=10) == [1]
    assert _planner({}).plan([0.9], [5], budget=10) == [0]  # nothing measured yet


def test_a_buckets_cost_is_the_median_of_its_recent_steps() -> None:
    """One slow step (the server's threads, a collection) does not make a bucket look slow: its cost is the median of
    its last STEP_SAMPLES steps, where an average would keep the planner out of it for a while."""
    planner = _planner({})
    for _ in range(6):
        planner.observe(7, 0.010)  # the 8-row bucket
    planner.observe(8, 0.050)
    assert planner.step_s[8] == pytest.approx(0.010)
    for _ in range(STEP_SAMPLES):  # a lasting change moves it all the same
        planner.observe(5, 0.020)
    assert planner.step_s[8] == pytest.approx(0.020)


def test_rate_is_the_chance_a_draft_is_kept_after_the_ones_before_it() -> None:
    # Keeping 4 of 7 drafts at every step means 4 kept of 5 tested (the fifth was rejected): 0.8 a token, not 4/7.
    copying = SpecState()
    for _ in range(30):
        copying.record(7, 4)
    assert copying.rate == pytest.approx(0.8, abs=1e-3)
    # Every draft kept: nothing rejected, the estimate climbs to 1 (the planner caps it, MAX_RATE).
    quoting = SpecState()
    for _ in range(30):
        quoting.record(3, 3)
    assert quoting.rate > 0.99
    failing = SpecState()
    for _ in range(30):
        failing.record(5, 0)
    assert failing.rate < 0.01
    assert (copying.proposed, copying.accepted, copying.verify_steps) == (210, 120, 30)
    # A step without drafts relaxes the estimate toward the prior, so a request that stopped drafting tries again.
    failing.record(0, 0)
    assert 0.005 < failing.rate < CLASS_PRIORS[0]


def test_each_match_class_keeps_its_own_rate() -> None:
    state = SpecState()
    top = len(MATCH_CLASSES) - 1
    state.cls = 0
    for _ in range(30):
        state.record(4, 0)  # fresh short matches keep failing
    state.cls = top
    for _ in range(30):
        state.record(4, 4)  # while copies in progress keep being kept
    assert state.rates[0] < 0.01 and state.rates[top] > 0.99 and state.rate == state.rates[top]
    assert state.rates[1:top] == list(CLASS_PRIORS[1:top])  # untouched


@dataclass
class _Req:
    """What the Speculator reads of an engine Request."""

    prompt_ids: list[int]
    max_new_tokens: int = 40
    output_ids: list[int] = field(default_factory=list)
    spec: Any = None
    matcher: Any = None
    pooling: Any = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


def test_a_new_request_starts_from_the_recent_acceptance() -> None:
    spec = Speculator((1, 2, 4, 8), lambda b: True, max_draft=7)
    spec.planner.step_s.update({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})
    old = _Req([9, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6, 7, 8])
    assert spec.drafts([old], budget=7) == [(0, 1, 2, 3, 4, 5, 6)]  # a 9-token match: a copy in progress
    top = len(MATCH_CLASSES) - 1
    assert old.spec is not None and old.spec.cls == top and old.spec.rate == CLASS_PRIORS[top]
    for _ in range(40):  # every draft it verifies is kept
        spec.verified(old, 6, 6)
    assert spec.recent_rates[top] > 0.99 and spec.recent_rates[:top] == list(CLASS_PRIORS[:top])
    new = _Req([9, 8, 7])
    spec.drafts([new], budget=7)
    # (it had nothing to propose, so this step relaxed its rates once toward the priors)
    assert new.spec is not None
    expect = spec.recent_rates[top] + (CLASS_PRIORS[top] - spec.recent_rates[top]) * RATE_RECOVERY
    assert new.spec.rates[top] == pytest.approx(expect)


# ---- whole engines ------------------------------------------------------------------------------------------
def _always_draft(core: EngineCore) -> EngineCore:
    assert core.speculator is not None
    core.speculator.planner.cost = lambda rows: 1.0 if rows <= 8 else None  # type: ignore[method-assign]
    return core


def _engine(folder: Path, spec: str, **overrides: Any) -> EngineCore:
    core = tiny_engine(folder, speculative=spec, **overrides)
    return _always_draft(core) if spec != "off" else core


def _repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase: the n-gram drafter has something to propose from the first step."""
    rng = random.Random(seed)
    return [[rng.randrange(5, 300) for _ in range(rng.randint(6, 15))] * rng.randint(2, 4) for _ in range(n)]


_run, _same = run_checked, assert_same_streams


@pytest.fixture(scope="module")
def folder(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("llama")


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.05, top_p=0.9, top_k=40, min_p=0.01, repetition_penalty=1.02,
                        frequency_penalty=0.01, logit_bias={7: 0.1}, seed=5, max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache", "no-cache"])
def test_output_equals_speculation_off_with_batch_mates(folder: Path, params: SamplingParams,
                                                        prefix_cache: bool) -> None:
    prompts = _repetitive_prompts(7)
    prompts.append(prompts[0][:10] + prompts[1])  # shares a prefix with request 0
    arrivals = [Arrival(i // 2, f"r{i}", p, params) for i, p in enumerate(prompts)]
    off = _run(_engine(folder, "off", disable_prefix_cache=not prefix_cache), arrivals)
    core = _engine(folder, "ngram", disable_prefix_cache=not prefix_cache)
    _same(off, _run(core, arrivals))
    assert core.speculator is not None and core.speculator.stats.accepted > 10


def test_retraction_n_choices_and_mixed_params(folder: Path) -> None:
    """A pool too small for the batch (admission pinned reckless, so requests are retracted and recomputed while
    they draft), n = 3 choices and greedy, seeded and min_tokens mates in one batch."""
    prompts = _repetitive_prompts(6, seed=3)
    params = [GREEDY, SEEDED, SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=30),
              SamplingParams(temperature=0.0, min_tokens=20, max_tokens=30)]
    arrivals = [Arrival(i, f"r{i}", p, params[i % len(params)]) for i, p in enumerate(prompts)]
    off = _run(_engine(folder, "off", max_total_tokens=260), arrivals, pin_new_token_ratio=0.0)
    core = _engine(folder, "ngram", max_total_tokens=260)
    _same(off, _run(core, arrivals, pin_new_token_ratio=0.0))
    assert core.scheduler.stats.retractions > 0
    assert core.speculator is not None and core.speculator.stats.accepted > 0


def test_stops_lengths_and_logprobs_as_without_speculation(folder: Path) -> None:
    core_off, core = _engine(folder, "off"), _engine(folder, "ngram")
    prompt = _repetitive_prompts(1, seed=11)[0]
    probe = _run(core_off, [Arrival(0, "p", prompt, GREEDY)])[("p", 0)]
    text = core.tokenizer.decode(probe.token_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a stop string in the middle of what greedy writes
    cases = [
        SamplingParams(temperature=0.0, max_tokens=40, stop=[stop], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[probe.token_ids[25]], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, logprobs=True, top_logprobs=3, ignore_eos=True),
    ]
    arrivals = [Arrival(0, f"c{i}", prompt, p) for i, p in enumerate(cases)]
    off, on = _run(core_off, arrivals), _run(core, arrivals)
    _same(off, on)
    assert on[("c0", 0)].finish_reason == "stop" and on[("c1", 0)].finish_reason == "length"
    assert len(on[("c1", 0)].token_ids) == 13
    for a, b in zip(off[("c3", 0)].logprobs, on[("c3", 0)].logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert core.speculator is not None and core.speculator.stats.accepted > 0


@pytest.mark.parametrize("pattern", ["(ab|cd){3,10}", "x(yz){2,8}w"])
def test_grammar_constrained_requests_draft_within_their_grammar(folder: Path, pattern: str) -> None:
    """Drafts are cut where the grammar would reject them and each draft row is masked by the grammar's state after
    the drafts before it: output equals speculation off and stays in the language."""
    import re

    from engine.grammar.spec import GrammarSpec

    params = SamplingParams(temperature=0.0, max_tokens=24, grammar=GrammarSpec("regex", pattern))
    prompts = _repetitive_prompts(3, seed=4)
    arrivals = [Arrival(0, "g", prompts[0], params), *(Arrival(0, f"r{i}", p, GREEDY) for i, p in enumerate(prompts[1:]))]
    core = _engine(folder, "ngram")
    on = _run(core, arrivals)
    _same(_run(_engine(folder, "off"), arrivals), on)
    assert re.fullmatch(pattern, on[("g", 0)].text), on[("g", 0)].text
    alone = _engine(folder, "ngram")
    assert _run(alone, [Arrival(0, "g", prompts[0], params)])[("g", 0)].text == on[("g", 0)].text
    assert alone.speculator is not None and alone.speculator.stats.accepted > 0


def test_unseeded_sampling_keeps_the_distribution(folder: Path) -> None:
    """The first four tokens of many unseeded samples, with and without speculation: the frequencies of the most
    common continuations agree within sampling noise (each draft is kept with the model's probability of it)."""
    # A random model's greedy text falls into a cycle: a prompt ending in one gives the drafter material, and
    # at temperature 0.2 the first four tokens still take dozens of values.
    prompt = _repetitive_prompts(1, seed=2)[0]
    for _ in range(2):  # (the second continuation of this seed's prompt is a cycle of five tokens)
        prompt += _run(_engine(folder, "off"), [Arrival(0, "g", prompt, GREEDY)])[("g", 0)].token_ids
    params = SamplingParams(temperature=0.2, max_tokens=4, n=4, ignore_eos=True)  # (4 rows left to draft in)

    def histogram(core: EngineCore, rounds: int) -> dict[tuple[int, ...], int]:
        counts: dict[tuple[int, ...], int] = {}
        for r in range(rounds):
            for stream in _run(core, [Arrival(0, f"s{r}", prompt, params)]).values():
                key = tuple(stream.token_ids)
                counts[key] = counts.get(key, 0) + 1
        return counts

    import torch

    torch.manual_seed(0)
    off = histogram(_engine(folder, "off"), 120)
    core = _engine(folder, "ngram")
    on = histogram(core, 120)
    total = 480
    for key in sorted(off, key=off.get, reverse=True)[:3]:  # type: ignore[arg-type]
        p = off[key] / total
        sigma = (2 * p * (1 - p) / total) ** 0.5
        assert abs(on.get(key, 0) / total - p) < 4 * sigma + 0.01, (key, off[key], on.get(key, 0))
    assert core.speculator is not None and core.speculator.stats.accepted > 100


def test_compiled_buckets_verify_drafts_like_plain_decode(folder: Path) -> None:
    """Verification runs in the compiled decode buckets (rows of one request share its table row): the same
    compiled engine with its speculator switched off gives the same tokens."""
    import torch._dynamo

    torch._dynamo.reset()
    core = _engine(folder, "ngram", disable_compile=False, decode_buckets=(4, 8))
    prompts = _repetitive_prompts(3, seed=8)
    arrivals = [Arrival(i, f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    on = _run(core, arrivals)
    assert core.speculator is not None and core.speculator.stats.accepted > 10
    assert core.runner.graphs.steps_per_bucket[0] == 0  # (bucket 0: eager steps)
    speculator, core.scheduler.speculator = core.scheduler.speculator, None
    try:
        _same(on, _run(core, arrivals))
    finally:
        core.scheduler.speculator = speculator


def test_a_finished_requests_text_drafts_for_the_next_one(folder: Path) -> None:
    """The shared index (engine/suffix_index.py): a second request with the first one's prompt copies the first
    one's answer from it, drafted from the first step on; without the index it drafts only from its own text."""
    rng = random.Random(21)
    prompt = [rng.randrange(5, 300) for _ in range(30)]  # no repeats: its own text proposes nothing at first
    kept: dict[bool, int] = {}
    for share in (True, False):
        core = _engine(folder, "ngram")
        assert core.speculator is not None
        if not share:
            core.speculator.shared = None
        first = _run(core, [Arrival(0, "a", prompt, GREEDY)])
        before = core.speculator.stats.accepted
        second = _run(core, [Arrival(0, "b", prompt, GREEDY)])
        kept[share] = core.speculator.stats.accepted - before
        assert second[("b", 0)].token_ids == first[("a", 0)].token_ids
    assert kept[True] >= 30 and kept[True] > kept[False] + 10, kept


def test_the_shared_index_keeps_a_token_budget() -> None:
    from engine.suffix_index import SharedIndex

    index = SharedIndex(max_tokens=100)
    index.add(list(range(60)))
    assert index.propose([7, 8, 9, 10], 3) == [11, 12, 13]
    index.add(list(range(100, 160)))  # 120 tokens: the first sequence goes, and every n-gram pointing into it
    assert index.tokens == 60 and index.propose([7, 8, 9, 10], 3) == []
    assert index.propose([140, 141, 142], 2) == [143, 144]
    assert all(sid in index.seqs for m in index.maps.values() for sid, _ in m.values())


def test_the_replay_script_counts_what_the_drafter_would_have_kept() -> None:
    """scripts/replay_spec.py's replay: the engine's drafter and planner against given greedy outputs."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "replay_spec.py"
    spec = importlib.util.spec_from_file_location("replay_spec", path)
    assert spec is not None and spec.loader is not None
    replay_spec = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay_spec)
    phrase = list(range(10, 40))
    copying = [[phrase + [1, 2], phrase[:24]] for _ in range(3)]  # each output copies its prompt's phrase
    flat = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}  # extra rows free: every proposal is verified
    tok_s, per_step, rows = replay_spec.replay(copying, 1, flat)
    assert per_step > 3 and rows > 4  # most of each output came from drafts
    assert tok_s / replay_spec.plain(copying, 1, flat) == pytest.approx(per_step)
    rng = random.Random(1)
    fresh = [[[rng.randrange(100, 10_000) for _ in range(30)], [rng.randrange(100, 10_000) for _ in range(24)]]
             for _ in range(3)]  # nothing to copy: no proposal, one token a step
    assert replay_spec.replay(fresh, 2, flat)[1] == 1.0
