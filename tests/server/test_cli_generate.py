"""`ember generate`: only the completion on stdout, logs on stderr, same tokens as the engine API."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.sampling_params import SamplingParams


def _ember(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", "generate", *args], capture_output=True, text=True,
                          timeout=600, check=False)


def test_generate_prints_only_the_completion(make_tiny_model, tmp_path: Path) -> None:
    folder = make_tiny_model("llama")
    compiled_cache, eager_cache = tmp_path / "compiled", tmp_path / "eager"
    run = _ember("--model", str(folder), "--prompt", "The capital of France", "--max-tokens", "12",
                 "--dtype", "float32", "--compile", "--compile-cache-dir", str(compiled_cache))
    assert run.returncode == 0, run.stderr
    eager = _ember("--model", str(folder), "--prompt", "The capital of France", "--max-tokens", "12",
                   "--dtype", "float32", "--compile-cache-dir", str(eager_cache))  # the default: no compile
    assert eager.returncode == 0, eager.stderr
    assert eager.stdout == run.stdout
    # The CLI compiles just the batch-1 bucket (and saves it); the eager run compiles nothing.
    assert [p.name for p in compiled_cache.glob("decode-steps/*/bucket-*.bin")] == ["bucket-1.bin"]
    assert not list(eager_cache.glob("decode-steps/*/bucket-*.bin"))
    core = EngineCore(EngineConfig(model=str(folder), dtype="float32", max_running_requests=1,
                                   max_total_tokens=512, disable_compile=True))
    ids = core.tokenizer.encode("The capital of France")
    core.add(core.make_requests("x", ids, SamplingParams(temperature=0.0, max_tokens=12)))
    text = ""
    while core.has_work():
        text += "".join(o.text for o in core.step())
    assert run.stdout == text + "\n"
    assert "ember.runner" in run.stderr  # the logs went to stderr


def test_generate_rejects_missing_model() -> None:
    run = _ember("--model", "/nonexistent/model", "--prompt", "hi")
    assert run.returncode != 0 and run.stdout == ""
    assert "/nonexistent/model" in run.stderr


@pytest.mark.slow
def test_default_model_answers_chat_question() -> None:
    # Not the capital of France: int8 activations tip its 0.08-logit near-tie, as llama.cpp's server does on this file
    run = _ember("--chat", "--prompt", "What is 2 + 2?", "--max-tokens", "20", "--dtype", "float32",
                 "--disable-compile")
    assert run.returncode == 0, run.stderr
    assert "4" in run.stdout
