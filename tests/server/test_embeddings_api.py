"""POST /v1/embeddings through the official openai client on a real server (tiny random Llama, mean pooling)."""
from __future__ import annotations

import base64
import threading

import httpx
import numpy as np
import openai
import pytest

from server_harness import MODEL_NAME, TINY_CONTEXT, Server, assert_error, metrics


def _vec(item: object) -> np.ndarray:
    return np.asarray(item.embedding, dtype=np.float64)  # type: ignore[attr-defined]


def test_identical_texts_agree_and_others_differ(client: openai.OpenAI) -> None:
    res = client.embeddings.create(model=MODEL_NAME, input=["The sea is calm.", "The sea is calm.", "Fire!"])
    a, b, c = (_vec(d) for d in res.data)
    assert [d.index for d in res.data] == [0, 1, 2]
    assert abs(np.linalg.norm(a) - 1) < 1e-5 and float(a @ b) == pytest.approx(1.0, abs=1e-6)
    assert float(a @ c) < 0.999
    tok = client.post("/tokenize", body={"prompt": "The sea is calm."}, cast_to=object)
    ids = tok["tokens"]  # type: ignore[index]
    assert res.usage.prompt_tokens == res.usage.total_tokens == 2 * len(ids) + len(
        client.post("/tokenize", body={"prompt": "Fire!"}, cast_to=object)["tokens"])  # type: ignore[index]
    by_ids = client.embeddings.create(model=MODEL_NAME, input=ids)  # token ids give the text's embedding
    assert np.abs(_vec(by_ids.data[0]) - a).max() < 1e-5


def test_dimensions_and_base64(client: openai.OpenAI, http: httpx.Client) -> None:
    full = _vec(client.embeddings.create(model=MODEL_NAME, input="hello world").data[0])
    short = _vec(client.embeddings.create(model=MODEL_NAME, input="hello world", dimensions=16).data[0])
    assert short.shape == (16,) and abs(np.linalg.norm(short) - 1) < 1e-5
    assert np.abs(short - full[:16] / np.linalg.norm(full[:16])).max() < 1e-5
    raw = http.post("/v1/embeddings",
                    json={"input": "hello world", "encoding_format": "base64"}).json()["data"][0]["embedding"]
    assert np.abs(np.frombuffer(base64.b64decode(raw), dtype="<f4") - full).max() < 1e-6
    # the SDK asks for base64 unless told otherwise and decodes it itself (that is `full`): the float answer agrees
    floats = http.post("/v1/embeddings", json={"input": "hello world", "encoding_format": "float"}).json()
    assert np.abs(np.asarray(floats["data"][0]["embedding"]) - full).max() < 1e-6


@pytest.mark.parametrize("body, param", [
    ({"input": "x" * 10, "dimensions": 100000}, "dimensions"),
    ({"input": [1] * (TINY_CONTEXT + 1)}, "input"),
    ({"input": []}, "input"),
    ({"input": [320000]}, "input"),
    ({"input": 3}, None),
    ({"input": "hi", "model": "no-such-model"}, "model"),
])
def test_bad_inputs_are_400s(http: httpx.Client, body: dict, param: str | None) -> None:
    resp = http.post("/v1/embeddings", json=body)
    status = 404 if param == "model" and resp.status_code == 404 else 400
    assert_error(resp, status)
    if param is not None and status == 400:
        assert resp.json()["error"]["param"] == param


def test_embeddings_share_the_engine_with_generation(client: openai.OpenAI, server: Server) -> None:
    """Embeddings computed while a long completion decodes equal those computed alone, and nothing leaks."""
    alone = [_vec(d) for d in client.embeddings.create(model=MODEL_NAME, input=["one", "two three"]).data]
    started = threading.Event()
    result: dict[str, object] = {}

    def long_completion() -> None:
        stream = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=120, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        text = ""
        for chunk in stream:
            started.set()
            text += chunk.choices[0].text if chunk.choices else ""
        result["text"] = text

    worker = threading.Thread(target=long_completion)
    worker.start()
    assert started.wait(60)
    during = [_vec(d) for d in client.embeddings.create(model=MODEL_NAME, input=["one", "two three"]).data]
    worker.join(120)
    assert result.get("text")
    for x, y in zip(alone, during):
        assert np.abs(x - y).max() < 1e-5
    m = metrics(server)
    assert m["ember:kv_pool_used_slots"] == 0 and m["ember:num_requests_running"] == 0
