"""Mixed steps: the running requests' decode rows (and their drafts) ride in a prefill forward. Outputs must be those
of the alternating schedule (greedy and seeded), every slot must come back, and the batch's layout must be what the
prefill path reads.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core import EngineCore
from engine.forward_batch import ForwardBatch, PrefillChunk
from engine.model.rope import longrope_rows
from engine.sampling_params import SamplingParams
from scheduler_helpers import Arrival, assert_same_streams, run_checked, tiny_engine


@pytest.fixture(scope="module")
def folder(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("llama")


def _arrivals(n: int = 12, seed: int = 5) -> list[Arrival]:
    """Prompts arriving while others decode, some longer than a prefill chunk; greedy and seeded, and prompts that
    repeat a phrase, so the n-gram drafter proposes from the first step."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(5, 300) for _ in range(rng.randint(4, 12))]
        prompt = phrase * rng.randint(1, 4)
        params = (SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=rng.randint(8, 30), ignore_eos=True)
                  if i % 3 == 2 else SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 30), ignore_eos=True))
        out.append(Arrival(rng.randint(0, 25), f"r{i}", prompt, params))
    return out


class _Recorder:
    """Wraps the runner's forward to keep each batch's kind."""

    def __init__(self, core: EngineCore) -> None:
        self.batches: list[ForwardBatch] = []
        inner = core.runner.forward

        def forward(batch: ForwardBatch) -> torch.Tensor:
            self.batches.append(batch)
            return inner(batch)

        core.runner.forward = forward  # type: ignore[method-assign]

    @property
    def mixed(self) -> list[ForwardBatch]:
        return [b for b in self.batches if b.parts is not None]


def _engine(folder: Path, mixed: bool, spec: str = "off", **overrides: Any) -> EngineCore:
    core = tiny_engine(folder, mixed_prefill=mixed, speculative=spec, **overrides)
    if core.speculator is not None:  # draft whenever there is a proposal (the tests pin the planner's costs)
        core.speculator.planner.cost = lambda rows: 1.0 if rows <= 8 else None  # type: ignore[method-assign]
    return core


@pytest.mark.parametrize("spec", ["off", "ngram"])
@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache", "no-cache"])
def test_mixed_steps_generate_what_alternating_steps_do(folder: Path, spec: str, prefix_cache: bool) -> None:
    arrivals = _arrivals()
    alternating = _engine(folder, False, disable_prefix_cache=not prefix_cache)
    expected = run_checked(alternating, arrivals)
    assert alternating.scheduler.stats.mixed_steps == 0
    core = _engine(folder, True, spec, disable_prefix_cache=not prefix_cache)
    rec = _Recorder(core)
    assert_same_streams(expected, run_checked(core, arrivals))
    stats = core.scheduler.stats
    assert stats.mixed_steps == len(rec.mixed) > 10
    # Fewer forwards than alternating: each mixed step is a prefill and a decode step in one.
    assert len(rec.batches) < stats.prefill_steps + stats.decode_steps
    if spec == "ngram":  # drafts were verified inside prefill forwards too
        assert any(b.parts[0].verifies for b in rec.mixed)
        assert core.speculator is not None and core.speculator.stats.accepted > 0


def test_a_dry_pool_prefills_alone_and_retracts_as_before(folder: Path) -> None:
    """A pool too small for everyone: mixing must never take the slots a decode row needs, and retraction and
    recompute still give the uninterrupted outputs."""
    arrivals = [Arrival(i // 3, f"q{i}", a.prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
                for i, a in enumerate(_arrivals(9, seed=8))]
    expected = run_checked(_engine(folder, False), arrivals)
    core = _engine(folder, True, max_total_tokens=200)
    assert_same_streams(expected, run_checked(core, arrivals, pin_new_token_ratio=0.0))
    assert core.scheduler.stats.retractions > 0 and core.scheduler.stats.mixed_steps > 0


def _decode_batch() -> ForwardBatch:
    # Request row 3 at position 9 verifying two drafts, request row 5 at position 4 with none.
    return ForwardBatch.decode(
        input_ids=torch.tensor([11, 12, 13, 21]), positions=torch.tensor([9, 10, 11, 4]),
        req_rows=torch.tensor([3, 3, 3, 5]), out_slots=torch.tensor([40, 41, 42, 43]),
        drafts=((12, 13), ()))


def test_the_mixed_layout_puts_each_requests_decode_rows_in_a_chunk_of_its_own() -> None:
    prefill = ForwardBatch.prefill([PrefillChunk(7, 2, [1, 2, 3], torch.tensor([50, 51, 52]), 5),
                                    PrefillChunk(8, 0, [4, 5], torch.tensor([53, 54]))], completes=(False, True))
    b = ForwardBatch.mixed(_decode_batch(), prefill)
    assert not b.is_decode and b.decode_rows == 4
    assert b.input_ids.tolist() == [11, 12, 13, 21, 1, 2, 3, 4, 5]
    assert b.positions.tolist() == [9, 10, 11, 4, 2, 3, 4, 0, 1]
    assert b.req_rows.tolist() == [3, 5, 7, 8]
    assert b.prefix_lens.tolist() == [9, 4, 2, 0]  # type: ignore[union-attr]
    assert b.prefill_lens.tolist() == [3, 1, 3, 2]  # type: ignore[union-attr]
    assert b.fill_lens.tolist() == [12, 5, 5, 2]  # type: ignore[union-attr]
    assert b.out_slots.tolist() == [40, 41, 42, 43, 50, 51, 52, 53, 54]
    # every decode row's logits, then each prompt chunk's last token's
    assert b.logit_rows.tolist() == [0, 1, 2, 3, 6, 8]  # type: ignore[union-attr]


def test_longrope_picks_the_decode_rows_factors_by_their_own_positions() -> None:
    """A verify chunk that crosses the original context: each decode row goes by its own position, as in a decode
    step, where a prompt chunk goes by the length its whole prefill reaches."""
    prefill = ForwardBatch.prefill([PrefillChunk(7, 0, [1, 2, 3], torch.tensor([50, 51, 52]), 12)])
    b = ForwardBatch.mixed(_decode_batch(), prefill)
    assert longrope_rows(b, 10).tolist() == [False, True, True, False, True, True, True]
    assert longrope_rows(_decode_batch(), 10).tolist() == [False, True, True, False]
