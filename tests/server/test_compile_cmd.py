"""`ember compile`: compiles the configured decode buckets into --compile-cache-dir and exits 0."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import MakeTinyModel


def test_compile_fills_the_cache_dir_and_exits_0(make_tiny_model: MakeTinyModel, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    run = subprocess.run(
        [sys.executable, "-m", "server.cli", "compile", "--model", str(make_tiny_model("llama")), "--dtype",
         "float32", "--max-running-requests", "2", "--max-total-tokens", "512", "--compile-cache-dir", str(cache)],
        capture_output=True, text=True, timeout=600, check=False, env={**env, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""
    assert "compiled decode buckets [1, 2] in" in run.stderr
    assert "inductor FX graph cache:" in run.stderr  # the line that says whether the cache was used
    assert any(cache.rglob("*.so")), "no compiled kernel in the cache dir"
