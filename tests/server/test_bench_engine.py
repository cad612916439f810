"""`ember bench-engine` runs end to end on a tiny model and reports every figure it promises (not a speed gate)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_engine_reports_all_figures(make_tiny_model, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "server.cli", "bench-engine", "--model", str(make_tiny_model("llama")),
         "--batches", "1,2", "--prompt-len", "8", "--output-len", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    for key in ("ember_compiled_tps", "ember_eager_tps", "transformers_tps"):
        assert set(report[key]) == {"1", "2"} and all(v > 0 for v in report[key].values()), key
    assert set(report["compile_seconds"]) == {"1", "2"}
    assert "vs hf" in run.stdout and "compile seconds per bucket" in run.stdout
