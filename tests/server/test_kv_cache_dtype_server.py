"""`ember serve --kv-cache-dtype int8` end to end: the flag reaches the engine, /get_server_info and the log's KV pool
line name the dtype and its bytes per token, and its greedy answers equal those of the same server with fp32 KV over
their first 6 tokens (the tiny model's logits are peaked)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from server_harness import TINY_CONTEXT, greedy, http_client, openai_client, tiny_server

PROMPTS = ["Once upon a time", "The quick brown fox", "1 2 3 4"]


@pytest.fixture(scope="module")
def folder(make_tiny_model: Any) -> Path:
    return make_tiny_model("llama", max_position_embeddings=TINY_CONTEXT)


def test_int8_kv_server_reports_its_dtype_and_answers(folder: Path, tmp_path: Path) -> None:
    with tiny_server(folder, tmp_path / "fp32.log") as srv:
        want = [greedy(openai_client(srv), p, max_tokens=6).choices[0].text for p in PROMPTS]
    log = tmp_path / "int8.log"
    with tiny_server(folder, log, "--kv-cache-dtype", "int8") as srv:
        with http_client(srv) as http:
            info = http.get("/get_server_info").json()
            metrics = http.get("/metrics").text
        got = [greedy(openai_client(srv), p, max_tokens=6).choices[0].text for p in PROMPTS]
    # 2 layers x (K, V) x 2 KV heads x (16 int8 values + a 4-byte scale), against 512 bytes in fp32
    assert info["kv_cache"] == {"dtype": "int8", "bytes_per_token": 2 * 2 * 2 * 20}
    assert info["dtype"] == "float32" and info["kv_pool_slots"] == 2 * TINY_CONTEXT  # --max-total-tokens still rules
    assert "slots of int8 (160 bytes a token" in log.read_text()
    assert 'ember:kv_bytes_per_token{dtype="int8"} 160.0' in metrics
    assert got == want
