"""Drive an EngineCore step by step: requests arrive at chosen step numbers, aborts happen at chosen steps, and
every choice's stream of outputs is collected and checked for well-formedness as it arrives.

Arrival times are step numbers, not wall-clock times, so a workload is deterministic and never sleeps.
After every step the pool accounting is checked against the scheduler's queues (see `check_accounting`).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams


def tiny_engine(folder: Path, **overrides: Any) -> EngineCore:
    """An fp32 eager engine over a tiny model: small chunks so 20-60 token prompts are prefilled in pieces.

    Speculation is off unless asked for: these tests count steps (arrivals, aborts at step numbers), and whether
    the planner drafts depends on measured step times (tests/engine/test_speculative.py pins them)."""
    settings: dict[str, Any] = dict(
        model=str(folder), dtype="float32", max_total_tokens=4096, max_running_requests=8,
        decode_buckets=(1, 2, 4, 8), disable_compile=True, chunked_prefill_size=16, num_threads=1,
        speculative="off",
    )
    settings.update(overrides)
    return EngineCore(EngineConfig(**settings))


@dataclass
class Stream:
    """Everything one choice (request id, index) streamed, concatenated."""

    token_ids: list[int] = field(default_factory=list)
    deltas: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    def take(self, out: RequestOutput) -> None:
        assert self.finish_reason is None, f"output after the final one: {out}"
        self.token_ids.extend(out.token_ids)
        self.deltas.append(out.text)
        if out.logprobs is not None:
            assert len(out.logprobs) == len(out.token_ids)
            assert [lp.token_id for lp in out.logprobs] == list(out.token_ids)
            self.logprobs.extend(out.logprobs)
        assert out.completion_tokens == len(self.token_ids)
        self.prompt_tokens = out.prompt_tokens
        self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


@dataclass(frozen=True)
class Arrival:
    step: int  # engine step number at which the request is added
    request_id: str
    prompt: list[int]
    params: SamplingParams | None  # None: an embedding request


def check_accounting(core: EngineCore) -> None:
    """Every KV slot is owned exactly once (free list, prefix cache, or one admitted request's own range), the
    cache's counters and locks are consistent, and queued requests hold nothing."""
    s = core.scheduler
    admitted = [*s.prefilling, *s.running]
    assert len(admitted) <= core.config.max_running_requests
    s.kvm.check(admitted)
    own = sum(r.kv_len - r.cached_len for r in admitted)
    assert core.runner.kv_pool.used_size() == s.kvm.cached_slots() + own
    assert all(0 <= r.cached_len <= r.kv_len for r in admitted)
    assert core.runner.req_pool.available_size() == core.runner.req_pool.size - len(admitted)
    assert len({r.req_row for r in admitted}) == len(admitted) and all(r.req_row > 0 for r in admitted)
    assert all(r.req_row == 0 and r.kv_len == 0 and r.cache_node is None for r in s.waiting)
    check_drafter(core)


def check_drafter(core: EngineCore, idle: bool = False) -> None:
    """A draft model's pool holds exactly its per-request states' slots and rows, none of a finished request."""
    drafter = core.drafter
    if drafter is None:
        return
    assert not any(r.finished for r in drafter.states)
    assert drafter.runner.kv_pool.used_size() == sum(st.slots.numel() for st in drafter.states.values())
    assert drafter.runner.req_pool.available_size() == drafter.runner.req_pool.size - len(drafter.states)
    assert not (idle and drafter.states)


def assert_idle_and_empty(core: EngineCore) -> None:
    """No work left, every request row back, no KV slot held: what is not free is unlocked prefix cache."""
    assert not core.has_work()
    kvm = core.scheduler.kvm
    kvm.check([])
    assert kvm.held_slots() == 0
    assert core.runner.kv_pool.available_size() == core.runner.kv_pool.num_slots - kvm.cached_slots()
    assert core.runner.req_pool.available_size() == core.runner.req_pool.size
    check_drafter(core, idle=True)


class Driver:
    """Steps `core`, adding requests and aborting them at given step numbers, and collects their streams."""

    def __init__(self, core: EngineCore, pin_new_token_ratio: float | None = None) -> None:
        self.core = core
        # Pinning the admission reserve (e.g. at 0) makes admission reckless, so retraction happens over and
        # over, also of half-prefilled and already-retracted requests: outputs must not depend on the heuristic.
        self.pin_new_token_ratio = pin_new_token_ratio
        self.streams: dict[tuple[str, int], Stream] = {}
        self.embeddings: dict[str, torch.Tensor] = {}  # embedding requests' results, by request id
        self.steps = 0
        self.mixed_steps = 0  # steps that began with both a decode batch and prefill work pending

    def add(self, request_id: str, prompt: list[int], params: SamplingParams | None) -> None:
        """params None: an embedding request, pooled as the engine's model says."""
        reqs = (self.core.make_requests(request_id, prompt, params) if params is not None
                else [self.core.make_embedding_request(request_id, prompt, self.core.pooling)])
        for r in reqs:
            self.streams[(request_id, r.index)] = Stream()
        self.core.add(reqs)

    def collect(self, outputs: Iterable[RequestOutput]) -> list[RequestOutput]:
        outputs = list(outputs)
        for out in outputs:
            self.streams[(out.request_id, out.index)].take(out)
            if out.embedding is not None:
                self.embeddings[out.request_id] = torch.tensor(out.embedding)
        return outputs

    def abort(self, request_id: str) -> list[RequestOutput]:
        outs = self.collect(self.core.abort(request_id))
        check_accounting(self.core)
        return outs

    def step(self) -> list[RequestOutput]:
        s = self.core.scheduler
        if self.pin_new_token_ratio is not None:
            s.new_token_ratio = self.pin_new_token_ratio
        self.mixed_steps += bool(s.running and (s.waiting or s.prefilling))
        outs = self.collect(self.core.step())
        self.steps += 1
        check_accounting(self.core)
        return outs

    def run(self, arrivals: Iterable[Arrival] = (), max_steps: int = 10_000,
            aborts: Mapping[int, Iterable[str]] | None = None) -> dict[tuple[str, int], Stream]:
        """Add each arrival at its step, abort `aborts[step]`'s request ids, step until nothing is left to do."""
        pending = sorted(arrivals, key=lambda a: a.step)
        aborts = dict(aborts or {})
        while pending or self.core.has_work():
            while pending and pending[0].step <= self.steps:
                a = pending.pop(0)
                self.add(a.request_id, a.prompt, a.params)
            for rid in aborts.pop(self.steps, ()):
                self.abort(rid)
            if self.core.has_work():
                self.step()
            else:  # idle until the next arrival: time is measured in steps, so an idle step still counts
                self.steps += 1
            assert self.steps < max_steps, "the engine did not finish"
        assert all(st.finish_reason is not None for st in self.streams.values())
        return self.streams


def run_solo(core: EngineCore, prompt: list[int], params: SamplingParams) -> Stream:
    """The request alone on an otherwise idle engine (choice 0)."""
    assert not core.has_work()
    streams = Driver(core).run([Arrival(0, "solo", prompt, params)])
    assert_idle_and_empty(core)
    return streams[("solo", 0)]


def run_checked(core: EngineCore, arrivals: list[Arrival], **kwargs: Any) -> dict[tuple[str, int], Stream]:
    """Driver(core, **kwargs).run(arrivals), then the engine must be idle with every slot back."""
    streams = Driver(core, **kwargs).run(arrivals)
    assert_idle_and_empty(core)
    return streams


def assert_same_streams(a: Mapping[tuple[str, int], Stream], b: Mapping[tuple[str, int], Stream]) -> None:
    """The same choices with the same tokens, text and finish."""
    assert a.keys() == b.keys()
    for key in a:
        assert b[key].token_ids == a[key].token_ids, key
        assert (b[key].text, b[key].finish_reason, b[key].stop_reason) == (a[key].text, a[key].finish_reason,
                                                                           a[key].stop_reason), key
