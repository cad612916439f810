"""The prepared-model cache (engine/loader/prepared.py): a restart with a compile cache skips the checkpoint."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

import engine.loader.prepared
import engine.model_runner
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loader import resolve_model_path
from engine.loader.prepared import PreparedModel
from engine.sampling_params import SamplingParams

PROMPTS = [[5, 9, 11, 40], [7, 3]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _core(folder: Path, cache: Path, dtype: str) -> EngineCore:
    return EngineCore(EngineConfig(model=str(folder), dtype=dtype, max_total_tokens=512, max_running_requests=2,
                                   disable_compile=True, compile_cache_dir=str(cache)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_restart_reads_the_prepared_copy_only(make_tiny_model: Callable[..., Path], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    folder = make_tiny_model("qwen2", tie_word_embeddings=True)
    first = _core(folder, tmp_path, dtype)
    want = first.generate(PROMPTS, GREEDY)
    entry = PreparedModel(tmp_path, resolve_model_path(str(folder)))
    assert (entry.dir / "ember.json").is_file() and (entry.dir / "tokenizer").is_dir()
    assert list(entry.dir.glob(f"weights-{dtype}*.safetensors"))

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the checkpoint was opened although a prepared copy exists")

    monkeypatch.setattr(engine.loader.prepared, "open_checkpoint", refuse)
    monkeypatch.setattr(engine.loader.prepared, "load_tokenizer", refuse)
    monkeypatch.setattr(engine.model_runner, "build_model", refuse)
    second = _core(folder, tmp_path, dtype)
    assert second.model_config == first.model_config
    assert second.model_config.sampling_defaults == first.model_config.sampling_defaults  # (not compared by ==)
    assert repr(second.model_config) == repr(first.model_config)  # the saved decode steps are named after it
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    assert second.generate(PROMPTS, GREEDY) == want


def test_changed_checkpoint_or_new_dtype_prepares_again(make_tiny_model: Callable[..., Path],
                                                        tmp_path: Path) -> None:
    folder = make_tiny_model("llama", seed=5)
    _core(folder, tmp_path, "float32")
    before = PreparedModel(tmp_path, folder).dir
    weights = next(folder.glob("*.safetensors"))
    stat = weights.stat()
    try:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # "edited": another entry
        after = PreparedModel(tmp_path, folder).dir
        assert after != before and not after.exists()
        _core(folder, tmp_path, "bfloat16")
        assert {p.name for p in after.glob("weights-*")} <= {"weights-bfloat16-dense.safetensors",
                                                             "weights-bfloat16-packed-dense.safetensors"}
        assert len(list(after.glob("weights-*"))) == 1
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the folder is shared by the session
