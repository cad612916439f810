"""Serving before every bucket is compiled (engine/decode_graphs.py, background=True): steps run eagerly or in a
larger ready bucket while the rest compile, each bucket is swapped in when ready, and the tokens never change."""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch._dynamo

from engine.compile_child import CompileChild, NoRoomForChild, room_for_child
from engine.config import EngineConfig
from engine.decode_graphs import EAGER, DecodeGraphs
from engine.loader import open_checkpoint
from engine.model_runner import ModelRunner
from engine_helpers import ManualBatch, make_runner, random_prompts

PROMPTS = random_prompts([6, 11, 3], 320, seed=4)


def _runner(folder: Path, buckets: tuple[int, ...], cache: Path | None, background: bool) -> ModelRunner:
    config = EngineConfig(model=str(folder), dtype="float32", max_total_tokens=2048, max_running_requests=4,
                          decode_buckets=buckets, compile_cache_dir=str(cache) if cache else None,
                          background_compile=background)
    return ModelRunner(config, open_checkpoint(str(folder)))


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Holds the background compile (its thread here, or the start of its child process) until the test sets it (no
    timing guesses)."""
    opened = threading.Event()
    for name in ("_compile_all", "_compile_in_child"):
        original = getattr(DecodeGraphs, name)

        def gated(self: DecodeGraphs, *args: object, original: Callable[..., None] = original) -> None:
            assert opened.wait(600), "the test never opened the gate"
            original(self, *args)

        monkeypatch.setattr(DecodeGraphs, name, gated)
    return opened


def test_serves_eagerly_until_buckets_are_ready_with_the_same_tokens(make_tiny_model: Callable[..., Path],
                                                                     gate: threading.Event) -> None:
    folder = make_tiny_model("llama")
    want = ManualBatch(make_runner(folder, compile=False), PROMPTS).decode(12)
    torch._dynamo.reset()
    runner = _runner(folder, (1, 2, 4), None, background=True)
    graphs = runner.graphs
    assert graphs.ready_buckets == [] and not graphs.compile_finished.is_set()  # capture returned before compiling
    batch = ManualBatch(runner, PROMPTS)
    batch.decode(5)
    assert graphs.steps_per_bucket[EAGER] == 5 and graphs.steps_per_bucket[4] == 0
    gate.set()
    assert graphs.compile_finished.wait(600)
    assert graphs.ready_buckets == [1, 2, 4]
    assert batch.decode(7) == want
    assert graphs.steps_per_bucket[4] == 7  # the compiled bucket took over once it was in


def test_saved_bucket_loads_at_once_and_serves_smaller_batches(make_tiny_model: Callable[..., Path],
                                                               tmp_path: Path, gate: threading.Event) -> None:
    folder = make_tiny_model("llama")
    want = ManualBatch(make_runner(folder, compile=False), PROMPTS[:1]).decode(8)
    gate.set()  # the first runner compiles synchronously: the gate only matters for the second
    torch._dynamo.reset()
    _runner(folder, (4,), tmp_path, background=False)  # saves bucket 4's step
    gate.clear()
    torch._dynamo.reset()
    runner = _runner(folder, (1, 2, 4), tmp_path, background=True)
    graphs = runner.graphs
    assert graphs.ready_buckets == [4] and graphs.outcomes[4].startswith("loaded")
    batch = ManualBatch(runner, PROMPTS[:1])
    batch.decode(3)
    assert graphs.steps_per_bucket[4] == 3 and graphs.steps_per_bucket[EAGER] == 0  # one row, padded to 4
    gate.set()
    assert graphs.compile_finished.wait(600)
    assert batch.decode(5) == want
    assert graphs.steps_per_bucket[1] == 5


def test_a_warm_start_loads_the_largest_saved_step_then_the_rest_in_the_background(
        make_tiny_model: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step saved: capture returns once the largest is loaded (every batch runs compiled, padded), the others
    load in the background, nothing compiles, and each takes over its batches when in."""
    folder = make_tiny_model("llama")
    want = ManualBatch(make_runner(folder, compile=False), PROMPTS[:1]).decode(8)
    torch._dynamo.reset()
    _runner(folder, (1, 2, 4), tmp_path, background=False)  # saves all three steps
    opened = threading.Event()
    original = DecodeGraphs._finish

    def gated(self: DecodeGraphs, *args: object) -> None:
        assert opened.wait(600), "the test never opened the gate"
        original(self, *args)

    monkeypatch.setattr(DecodeGraphs, "_finish", gated)
    torch._dynamo.reset()
    runner = _runner(folder, (1, 2, 4), tmp_path, background=True)
    graphs = runner.graphs
    assert graphs.ready_buckets == [4] and not graphs.compile_finished.is_set()
    batch = ManualBatch(runner, PROMPTS[:1])
    batch.decode(3)
    assert graphs.steps_per_bucket[4] == 3 and graphs.steps_per_bucket[EAGER] == 0  # one row, padded to 4
    opened.set()
    assert graphs.compile_finished.wait(600)
    assert graphs.ready_buckets == [1, 2, 4]
    assert all(graphs.outcomes[b].startswith("loaded") for b in (1, 2, 4)), graphs.outcomes
    assert batch.decode(5) == want
    assert graphs.steps_per_bucket[1] == 5


def test_stop_ends_the_background_compile(make_tiny_model: Callable[..., Path], gate: threading.Event) -> None:
    torch._dynamo.reset()
    runner = _runner(make_tiny_model("llama"), (1, 2, 4), None, background=True)
    runner.graphs.stop(0)  # as EngineThread.stop does, here before the first bucket
    gate.set()
    assert runner.graphs.compile_finished.wait(60)
    assert runner.graphs.ready_buckets == []


def _failing_child(code: str) -> Callable[[list[int]], CompileChild]:
    """A real child process that fails the way a compile child can: it dies, or announces a bucket it never saved."""
    return lambda buckets: CompileChild([sys.executable, "-c", code])


@pytest.mark.parametrize("code", ["import sys; sys.exit(3)", "print('ready 2 1.0', flush=True)"],
                         ids=["dies", "announces-a-bucket-it-did-not-save"])
def test_a_failed_compile_child_leaves_the_buckets_to_the_thread(make_tiny_model: Callable[..., Path], tmp_path: Path,
                                                                code: str) -> None:
    folder = make_tiny_model("llama")
    want = ManualBatch(make_runner(folder, compile=False), PROMPTS).decode(6)
    torch._dynamo.reset()
    config = EngineConfig(model=str(folder), dtype="float32", max_total_tokens=2048, max_running_requests=4,
                          decode_buckets=(2, 4), disable_compile=True)
    runner = ModelRunner(config, open_checkpoint(str(folder)))  # eager: the graphs below are the test's
    graphs = DecodeGraphs(runner.graphs.step, (2, 4), True, artifact_dir=tmp_path / "steps")
    graphs.capture(runner.req_pool.table, runner.k_caches, runner.v_caches, background=True,
                   spawn_child=_failing_child(code))
    assert graphs.compile_finished.wait(600)
    assert graphs.ready_buckets == [2, 4] and graphs.child_pid is None
    assert all(o.startswith("compiled ahead of time") for o in graphs.outcomes.values())  # here, not by the child
    runner.graphs = graphs
    assert ManualBatch(runner, PROMPTS).decode(6) == want
    assert graphs.steps_per_bucket[4] == 6


def test_no_room_for_a_compile_child_leaves_the_buckets_eager(make_tiny_model: Callable[..., Path],
                                                              tmp_path: Path) -> None:
    """Where a compile child would not fit beside the server, nothing compiles here either (that would stall serving
    for minutes): the buckets run eagerly, with the same tokens."""
    folder = make_tiny_model("llama")
    want = ManualBatch(make_runner(folder, compile=False), PROMPTS).decode(6)
    torch._dynamo.reset()
    config = EngineConfig(model=str(folder), dtype="float32", max_total_tokens=2048, max_running_requests=4,
                          decode_buckets=(2, 4), disable_compile=True)
    runner = ModelRunner(config, open_checkpoint(str(folder)))

    def no_room(buckets: list[int]) -> CompileChild:
        raise NoRoomForChild("a compile child needs 9.0 GiB and 1.0 GiB are available")

    graphs = DecodeGraphs(runner.graphs.step, (2, 4), True, artifact_dir=tmp_path / "steps")
    graphs.capture(runner.req_pool.table, runner.k_caches, runner.v_caches, background=True, spawn_child=no_room)
    assert graphs.compile_finished.wait(60)
    assert graphs.ready_buckets == [] and not list(tmp_path.glob("steps/*.bin"))
    runner.graphs = graphs
    assert ManualBatch(runner, PROMPTS).decode(6) == want


def test_room_for_a_compile_child_counts_its_weights_and_the_servers_pool(make_tiny_model: Callable[..., Path],
                                                                         tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 2**30
    assert room_for_child(4 * gib, 2 * gib, available_bytes=8 * gib) is None
    why = room_for_child(14 * gib, 2 * gib, available_bytes=9 * gib)
    assert why is not None and "17.0 GiB" in why and "9.0 GiB are available" in why
    # The server's spawner asks before it starts a child (here: as if 64 MiB were left).
    config = EngineConfig(model=str(make_tiny_model("llama")), dtype="float32", max_total_tokens=2048,
                          max_running_requests=4, decode_buckets=(2,), compile_cache_dir=str(tmp_path),
                          disable_compile=True, background_compile=True)
    runner = ModelRunner(config, open_checkpoint(config.model))
    runner.graphs.artifact_dir = tmp_path / "steps"
    spawn = runner._compile_child_spawner()
    assert spawn is not None
    monkeypatch.setattr("engine.compile_child.psutil.virtual_memory", lambda: type("M", (), {"available": 2**26})())
    with pytest.raises(NoRoomForChild, match="are available"):
        spawn([2])
