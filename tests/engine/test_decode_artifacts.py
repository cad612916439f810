"""Saved decode steps (engine/decode_graphs.py `artifact_dir`): a restart loads every bucket instead of compiling."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch._dynamo

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loader import open_checkpoint
from engine.model_runner import ModelRunner
from engine.ops.native import NATIVE_LINEAR, forced_isa
from engine.sampling_params import SamplingParams
from isa_tiers import LINEAR

# bf16 on every tier with a packed linear kernel, and fp32: no dtype or CPU falls back to freezing.
CASES = [pytest.param("bfloat16", p.values[0], id=f"bfloat16-{p.id}", marks=p.marks) for p in LINEAR]
CASES.append(pytest.param("float32", None, id="float32"))
PROMPTS = [[5, 9, 11, 40, 2], [7, 3]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _core(folder: Path, cache: Path, max_total_tokens: int = 512, dtype: str = "bfloat16",
          cpp_wrapper: bool = False) -> EngineCore:
    return EngineCore(EngineConfig(model=str(folder), dtype=dtype, max_total_tokens=max_total_tokens,
                                   max_running_requests=2, compile_cache_dir=str(cache), cpp_wrapper=cpp_wrapper))


def _eager_tokens(folder: Path) -> list:
    """PROMPTS' GREEDY tokens from the eager fp32 model: what every compiled step must reproduce."""
    eager = EngineCore(EngineConfig(model=str(folder), dtype="float32", max_total_tokens=512, max_running_requests=2,
                                    disable_compile=True))
    return eager.generate(PROMPTS, GREEDY)


@pytest.mark.parametrize("dtype,isa", CASES)
def test_restart_loads_saved_steps_and_decodes_the_same(make_tiny_model: Callable[..., Path], tmp_path: Path,
                                                        dtype: str, isa: str | None) -> None:
    with forced_isa(isa) if isa else contextlib.nullcontext():
        _restart_loads_saved_steps(make_tiny_model("llama", tie_word_embeddings=True), tmp_path, dtype)


def _restart_loads_saved_steps(folder: Path, tmp_path: Path, dtype: str) -> None:
    torch._dynamo.reset()
    first = _core(folder, tmp_path, dtype=dtype)
    graphs = first.runner.graphs
    assert graphs.artifact_dir is not None
    assert first.runner.model.packed == NATIVE_LINEAR  # both dtypes run packed kernels on AVX2 and up
    assert all(o.startswith("compiled ahead of time") for o in graphs.outcomes.values())
    assert sorted(p.name for p in graphs.artifact_dir.iterdir()) == ["bucket-1.bin", "bucket-2.bin"]
    want = first.generate(PROMPTS, GREEDY)
    assert first.runner.graphs.steps_per_bucket[2] > 0  # the batch of two really ran the compiled bucket

    torch._dynamo.reset()  # as in a new process: nothing compiled is left in memory
    second = _core(folder, tmp_path, dtype=dtype)
    assert second.runner.graphs.artifact_dir == graphs.artifact_dir
    assert all(o.startswith("loaded") for o in second.runner.graphs.outcomes.values())
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert second.generate(PROMPTS, GREEDY) == want
        assert second.generate(PROMPTS[:1], GREEDY) == want[:1]  # bucket 1 too


def test_cpp_wrapper_steps_save_load_and_decode_as_eager(make_tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """`ember serve` compiles its decode steps with inductor's C++ wrapper (the suite's other tests take the Python
    one, which compiles in half the time): its steps are saved and loaded as the Python wrapper's are, their folder
    is their own, and they decode in fp32 exactly as the eager model does."""
    folder = make_tiny_model("llama", tie_word_embeddings=True)
    want = _eager_tokens(folder)
    torch._dynamo.reset()
    first = _core(folder, tmp_path, dtype="float32", cpp_wrapper=True)
    graphs = first.runner.graphs
    assert graphs.cpp_wrapper and all(o.startswith("compiled ahead of time") for o in graphs.outcomes.values())
    assert first.generate(PROMPTS, GREEDY) == want
    torch._dynamo.reset()  # as in a new process
    again = _core(folder, tmp_path, dtype="float32", cpp_wrapper=True)
    assert again.runner.graphs.artifact_dir == graphs.artifact_dir
    assert all(o.startswith("loaded") for o in again.runner.graphs.outcomes.values())
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert again.generate(PROMPTS, GREEDY) == want
        assert again.generate(PROMPTS[:1], GREEDY) == want[:1]
    assert again.runner.graphs.steps_per_bucket[2] > 0 and again.runner.graphs.steps_per_bucket[1] > 0
    python_wrapper = EngineConfig(model=str(folder), dtype="float32", max_total_tokens=512, max_running_requests=2,
                                  compile_cache_dir=str(tmp_path), disable_compile=True)
    assert ModelRunner(python_wrapper, open_checkpoint(str(folder)))._decode_artifact_dir() != graphs.artifact_dir


def test_another_pool_size_loads_every_saved_step_and_decodes_as_eager(make_tiny_model: Callable[..., Path],
                                                                       tmp_path: Path) -> None:
    """The KV pool follows the memory free at start (or --max-total-tokens); its slot count is symbolic in the saved
    steps, so a restart with another pool size loads every bucket instead of compiling them all again."""
    folder = make_tiny_model("llama", tie_word_embeddings=True)
    want = _eager_tokens(folder)
    torch._dynamo.reset()
    first = _core(folder, tmp_path, max_total_tokens=512, dtype="float32")
    assert all(o.startswith("compiled ahead of time") for o in first.runner.graphs.outcomes.values())
    torch._dynamo.reset()  # as in a new process
    other = _core(folder, tmp_path, max_total_tokens=1999, dtype="float32")
    graphs = other.runner.graphs
    assert other.runner.kv_pool.num_slots == 1999 and all(k.shape[0] == 2000 for k in other.runner.k_caches)
    assert graphs.artifact_dir == first.runner.graphs.artifact_dir
    assert sorted(graphs.outcomes) == [1, 2] and all(o.startswith("loaded") for o in graphs.outcomes.values())
    assert max(graphs.compile_seconds.values()) < min(first.runner.graphs.compile_seconds.values())
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert other.generate(PROMPTS, GREEDY) == want
        assert other.generate(PROMPTS[:1], GREEDY) == want[:1]
    assert graphs.steps_per_bucket[2] > 0 and graphs.steps_per_bucket[1] > 0
    assert sorted(p.name for p in (tmp_path / "decode-steps").iterdir()) == [graphs.artifact_dir.name]


def test_the_pool_size_from_free_memory_does_not_change_the_saved_steps(make_tiny_model: Callable[..., Path],
                                                                        tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --max-total-tokens the pool is a fraction of the memory free at start: two starts that see different
    free memory name the same folder of saved steps (nothing is compiled here: the folder is only named)."""
    import psutil

    folder = make_tiny_model("llama", tie_word_embeddings=True)
    real = psutil.virtual_memory
    dirs, slots = [], []
    for free in (500_000, 800_000):  # bytes: 292 and 468 slots of 512 bytes (the cap is 2 x 256)
        monkeypatch.setattr(psutil, "virtual_memory", lambda free=free: real()._replace(available=free))
        config = EngineConfig(model=str(folder), dtype="float32", max_running_requests=2, max_context_len=256,
                              compile_cache_dir=str(tmp_path), disable_compile=True)
        runner = ModelRunner(config, open_checkpoint(str(folder)))
        dirs.append(runner._decode_artifact_dir())
        slots.append(runner.kv_pool.num_slots)
    assert slots[0] != slots[1] and dirs[0] == dirs[1]


def test_unreadable_step_compiles_again(make_tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    folder = make_tiny_model("llama", tie_word_embeddings=True)
    first = _core(folder, tmp_path)
    assert first.runner.graphs.artifact_dir is not None
    (first.runner.graphs.artifact_dir / "bucket-1.bin").write_bytes(b"not a saved step")
    torch._dynamo.reset()
    again = _core(folder, tmp_path)
    assert again.runner.graphs.outcomes[1].startswith("compiled ahead of time")  # the broken file was replaced
    assert again.runner.graphs.outcomes[2].startswith("loaded")
