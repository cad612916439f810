"""Saved decode steps (engine/decode_graphs.py `artifact_dir`): a restart loads every bucket instead of compiling."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch._dynamo

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.ops.native import NATIVE_LINEAR, forced_isa
from engine.sampling_params import SamplingParams
from isa_tiers import LINEAR

# bf16 on every tier with a packed linear kernel, and fp32: no dtype or CPU falls back to freezing.
CASES = [pytest.param("bfloat16", p.values[0], id=f"bfloat16-{p.id}", marks=p.marks) for p in LINEAR]
CASES.append(pytest.param("float32", None, id="float32"))


def _core(folder: Path, cache: Path, max_total_tokens: int = 512, dtype: str = "bfloat16") -> EngineCore:
    return EngineCore(EngineConfig(model=str(folder), dtype=dtype, max_total_tokens=max_total_tokens,
                                   max_running_requests=2, compile_cache_dir=str(cache)))


@pytest.mark.parametrize("dtype,isa", CASES)
def test_restart_loads_saved_steps_and_decodes_the_same(make_tiny_model: Callable[..., Path], tmp_path: Path,
                                                        dtype: str, isa: str | None) -> None:
    with forced_isa(isa) if isa else contextlib.nullcontext():
        _restart_loads_saved_steps(make_tiny_model("llama", tie_word_embeddings=True), tmp_path, dtype)


def _restart_loads_saved_steps(folder: Path, tmp_path: Path, dtype: str) -> None:
    prompts = [[5, 9, 11, 40, 2], [7, 3]]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    torch._dynamo.reset()
    first = _core(folder, tmp_path, dtype=dtype)
    graphs = first.runner.graphs
    assert graphs.artifact_dir is not None
    assert first.runner.model.packed == NATIVE_LINEAR  # both dtypes run packed kernels on AVX2 and up
    assert all(o.startswith("compiled ahead of time") for o in graphs.outcomes.values())
    assert sorted(p.name for p in graphs.artifact_dir.iterdir()) == ["bucket-1.bin", "bucket-2.bin"]
    want = first.generate(prompts, greedy)
    assert first.runner.graphs.steps_per_bucket[2] > 0  # the batch of two really ran the compiled bucket

    torch._dynamo.reset()  # as in a new process: nothing compiled is left in memory
    second = _core(folder, tmp_path, dtype=dtype)
    assert second.runner.graphs.artifact_dir == graphs.artifact_dir
    assert all(o.startswith("loaded") for o in second.runner.graphs.outcomes.values())
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert second.generate(prompts, greedy) == want
        assert second.generate(prompts[:1], greedy) == want[:1]  # bucket 1 too


def test_other_pool_shape_or_unreadable_step_compiles_again(make_tiny_model: Callable[..., Path],
                                                            tmp_path: Path) -> None:
    folder = make_tiny_model("llama", tie_word_embeddings=True)
    first = _core(folder, tmp_path)
    other = _core(folder, tmp_path, max_total_tokens=640)  # the pool's shape is part of every graph
    assert other.runner.graphs.artifact_dir != first.runner.graphs.artifact_dir
    assert first.runner.graphs.artifact_dir is not None
    (first.runner.graphs.artifact_dir / "bucket-1.bin").write_bytes(b"not a saved step")
    torch._dynamo.reset()
    again = _core(folder, tmp_path)
    assert again.runner.graphs.outcomes[1].startswith("compiled ahead of time")  # the broken file was replaced
    assert again.runner.graphs.outcomes[2].startswith("loaded")
