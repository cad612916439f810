"""guidellm (the vLLM project's load generator) against a real server: a handful of synchronous streamed chat
requests, none of which may error. guidellm sends `stream_options.continuous_usage_stats` on every request
and reads its token counts from the per-chunk usage.

guidellm 0.8.1 pulls pandas, pyarrow, datasets and sanic, and in a fresh venv a CUDA torch (through its torch
dependency), so it is not in the test extra: the test installs it into .venv-guidellm, a venv that sees this
one's packages (a .pth file, so torch==2.13.0 CPU is found and nothing is downloaded for it) and keeps guidellm's
own pins (click, python-dateutil, ...) out of .venv. It skips when that install cannot be done (no registry).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from server_harness import API_KEY, MODEL_NAME, REPO, TINY_CONTEXT, Server

GUIDELLM = "guidellm==0.8.1"
VENV = REPO / ".venv-guidellm"
pytestmark = pytest.mark.slow


def _guidellm() -> Path:
    exe = VENV / "bin" / "guidellm"
    if exe.is_file():
        return exe
    try:
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=120)
        site = VENV / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
        (site / "ember-main.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", GUIDELLM], check=True, timeout=900,
                       capture_output=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"could not install {GUIDELLM} into {VENV}: {exc}")
    return exe


def test_guidellm_synchronous_run_has_no_errored_request(server: Server, make_tiny_model: Any,
                                                        tmp_path: Path) -> None:
    exe = _guidellm()
    tokenizer = make_tiny_model("llama", max_position_embeddings=TINY_CONTEXT)  # the served model's folder
    report = tmp_path / "report.json"
    cmd = [str(exe), "run",
           "--backend", f"kind=openai_http,target={server.base_url},model={MODEL_NAME},api_key={API_KEY}",
           "--profile", "kind=synchronous",
           "--constraint", "kind=max_requests,count=5",
           "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
           "--tokenizer", f"kind=hf_auto,model={tokenizer}",
           "--output", f"kind=json,path={report}",
           "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(report.read_text())
    totals = data["benchmarks"][0]["metrics"]["request_totals"]
    assert totals["errored"] == 0 and totals["incomplete"] == 0, totals
    assert totals["successful"] == 5, totals
    assert "continuous_usage_stats" not in server.log()  # no request was refused for it
