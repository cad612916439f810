"""`ember generate`: only the completion on stdout, logs on stderr, same tokens as the engine API."""
from __future__ import annotations

import subprocess
import sys

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.sampling_params import SamplingParams


def _ember(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", "generate", *args], capture_output=True, text=True,
                          timeout=600, check=False)


def test_generate_prints_only_the_completion(make_tiny_model) -> None:
    folder = make_tiny_model("llama")
    run = _ember("--model", str(folder), "--prompt", "The capital of France", "--max-tokens", "12",
                 "--dtype", "float32", "--compile")  # the CLI compiles just the batch-1 bucket
    assert run.returncode == 0, run.stderr
    eager = _ember("--model", str(folder), "--prompt", "The capital of France", "--max-tokens", "12",
                   "--dtype", "float32")  # the default: no compile, and no dynamo import
    assert eager.returncode == 0, eager.stderr
    assert "decode buckets [1] (eager)" in eager.stderr and eager.stdout == run.stdout
    core = EngineCore(EngineConfig(model=str(folder), dtype="float32", max_running_requests=1,
                                   max_total_tokens=512, disable_compile=True))
    ids = core.tokenizer.encode("The capital of France")
    core.add(core.make_requests("x", ids, SamplingParams(temperature=0.0, max_tokens=12)))
    text = ""
    while core.has_work():
        text += "".join(o.text for o in core.step())
    assert run.stdout == text + "\n"
    assert "decode bucket 1 [1/1] ready in" in run.stderr  # logs go to stderr


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
