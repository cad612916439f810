"""A sliding-window model served with the prefix cache on: /get_server_info and /metrics show the window layers' own
slots (engine/window_slots.py), and a long answer gives its out-of-window slots back as it goes."""
from __future__ import annotations

from pathlib import Path

import pytest

from server_harness import greedy, http_client, openai_client, tiny_server
from tiny_gemma3 import WINDOW, write_tiny_gemma3


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "gemma3-window")


def _metric(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
    return float(line.split()[1])


def test_window_slots_are_reported_and_given_back(folder: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with tiny_server(folder, log, "--window-kv-ratio", "0.5") as srv:
        answer = greedy(openai_client(srv), "Once upon a time there was", max_tokens=40)
        with http_client(srv) as http:
            info = http.get("/get_server_info").json()["kv_cache"]
            metrics = http.get("/metrics").text
    assert answer.usage.completion_tokens == 40
    # 2 full layers hold every token; 4 window layers (2 KV heads x 16 fp32 values, K and V) only some
    assert info["bytes_per_token"] == 2 * 2 * 2 * 16 * 4 and info["window_bytes_per_token"] == 4 * 2 * 2 * 16 * 4
    # half of the pool (capped at 4 rows x the model's 256 positions, the window map's size) is 512, below the floor
    # of 4 windows plus one 512-token prefill chunk
    assert info["window_slots"] == 4 * (WINDOW - 1) + 512 + 1 and 0 < info["window_slots_used"] < 40
    assert _metric(metrics, "ember:kv_window_total_slots") == info["window_slots"]
    assert _metric(metrics, "ember:kv_window_trimmed_tokens_total") >= 40 - WINDOW
    assert _metric(metrics, "ember:kv_window_reclaimed_tokens_total") == 0
    assert f"in {info['window_slots']} slots of their own" in log.read_text()
