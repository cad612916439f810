"""OpenAI's Codex CLI (`npm install -g @openai/codex`) against Ember's /v1/responses: `codex exec` on a trivial task
completes its turn without a protocol error on either side.

The model is the tiny random one: Codex's answer is gibberish, but its whole request (a ~23k-token prompt in the
tiny byte-level tokenizer, a dozen tools of which Ember leaves out the hosted ones, `include`, `prompt_cache_key`)
and Ember's streamed events are the real ones. Skipped where `codex` is not installed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from server_harness import API_KEY, MODEL_NAME, tiny_server

pytestmark = pytest.mark.skipif(shutil.which("codex") is None,
                                reason="the Codex CLI is not installed (npm install -g @openai/codex)")

CONTEXT = 32768  # Ember's largest context; Codex's prompt needs ~23k tokens of the tiny tokenizer


def _config(base_url: str) -> str:
    return f"""model = "{MODEL_NAME}"
model_provider = "ember"

[model_providers.ember]
name = "Ember"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "EMBER_TEST_API_KEY"
"""


def test_codex_exec_completes_a_turn(make_tiny_model, tmp_path: Path) -> None:
    model = make_tiny_model("llama", max_position_embeddings=CONTEXT)
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    with tiny_server(model, tmp_path / "server.log", "--max-total-tokens", str(2 * CONTEXT),
                     "--max-context-len", str(CONTEXT)) as server:
        (home / "config.toml").write_text(_config(server.base_url))
        env = {**os.environ, "CODEX_HOME": str(home), "EMBER_TEST_API_KEY": API_KEY}
        done = subprocess.run(["codex", "exec", "--skip-git-repo-check", "Say hello."], cwd=work, env=env,
                              capture_output=True, text=True, errors="replace", timeout=300,
                              stdin=subprocess.DEVNULL)
        log = server.log()
    shown = f"codex rc={done.returncode}\nstdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, shown
    assert "ERROR" not in done.stderr and "stream disconnected" not in done.stderr, shown
    assert "tokens used" in done.stderr, shown  # Codex's summary line after a finished turn
    assert "responses request: left out tools Ember cannot run" in log  # Codex's hosted tools, not refused
    finished = [line for line in log.splitlines() if "ember.requests: request resp_" in line]
    assert finished and all("finish_reason=stop" in line or "finish_reason=length" in line for line in finished), log
    assert "Traceback" not in log and "error while streaming" not in log, log[-4000:]
