"""The prefix cache's disk tier across a real restart: `ember serve --kv-disk-cache-size` writes a long prompt's
K/V blocks, exits on SIGTERM, and the next server on the same cache directory reads them back (the prompt's
tokens come back as cached_tokens) and answers with the same tokens."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from server_harness import MODEL_NAME, metrics, openai_client, run_server, tiny_server_args

BLOCK = 64  # engine/kv_disk.py BLOCK_TOKENS


@pytest.fixture(scope="module")
def tiny_model(make_tiny_model) -> Path:  # type: ignore[no-untyped-def]
    return make_tiny_model("llama", max_position_embeddings=16384)


def test_a_restarted_server_serves_the_cached_prompt_from_disk(tiny_model: Path, tmp_path: Path) -> None:
    args = [*tiny_server_args(tiny_model), "--compile-cache-dir", str(tmp_path / "cache"),
            "--kv-disk-cache-size", "64"]
    prompt = [random.Random(3).randrange(5, 300) for _ in range(5 * BLOCK + 9)]

    def ask(server) -> tuple[str, int]:  # type: ignore[no-untyped-def]
        out = openai_client(server).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16,
                                                       temperature=0, extra_body={"ignore_eos": True})
        return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens

    with run_server(args, tmp_path / "first.log") as first:
        text, cached = ask(first)
        assert cached == 0
        assert first.log().count("KV disk tier:") == 1
    with run_server(args, tmp_path / "second.log") as second:
        again, cached = ask(second)
        assert again == text
        assert cached == 5 * BLOCK  # every whole block of the prompt (less its last token) came from disk
        m = metrics(second)
        assert m["ember:kv_disk_hit_tokens_total"] == 5 * BLOCK and m["ember:kv_disk_bytes"] > 0
