"""Every error class of the HTTP API: status, OpenAI's error shape, no traceback. 400 (invalid field, over the
context, n over the limit), 401, 404 (model, route), 405, 413 (declared and chunked bodies), 503 with
Retry-After when the queue is full, and exit code 1 when the engine cannot start."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from server_harness import (
    API_KEY,
    MAX_BYTES,
    MAX_N,
    MAX_QUEUED,
    MAX_RUNNING,
    MODEL_NAME,
    REPO,
    TINY_CONTEXT,
    Server,
    assert_error,
    free_port,
    http_client,
    idle,
    metrics,
    openai_client,
    wait_until,
)


def test_400_invalid_fields_in_openai_shape(client: openai.OpenAI, http: httpx.Client) -> None:
    assert_error(http.post("/v1/completions", json={"prompt": "x", "temperature": "hot"}), 400, "temperature")
    assert_error(http.post("/v1/completions", json={"prompt": "x", "temperature": -1}), 400, "temperature")
    assert_error(http.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    assert_error(http.post("/v1/tokenize", json={"messages": []}), 400, "messages")  # was a 500 (found by fuzzing)
    assert_error(http.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}), 400)
    assert_error(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                 400)
    assert_error(http.post("/v1/completions", json={"prompt": [999999]}), 400, "prompt")
    assert_error(http.post("/v1/completions", json={"prompt": "x", "logit_bias": {"abc": 1}}), 400, "logit_bias")
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=8, top_p=0)
    assert exc.value.status_code == 400 and exc.value.body["param"] == "top_p"


def test_400_over_context_and_n_over_limit(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=TINY_CONTEXT + 1)
    assert exc.value.body["param"] == "max_tokens" and exc.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc:  # streaming requests are refused before the 200
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=TINY_CONTEXT + 1, stream=True)
    assert exc.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, n=MAX_N + 1)
    assert exc.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as exc:  # n times the number of prompts counts too
        client.completions.create(model=MODEL_NAME, prompt=["a", "b", "c"], max_tokens=2, n=2)
    assert exc.value.body["param"] == "n"


def test_401_auth(server: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": f"Basic {API_KEY}"}):
        err = assert_error(httpx.get(server.base_url + "/v1/models", headers=headers), 401)
        assert err["type"] == "authentication_error"
    assert httpx.get(server.base_url + "/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai_client(server, api_key="nope").completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
    assert httpx.get(server.base_url + "/health").status_code == 200  # probes stay open
    assert httpx.get(server.base_url + "/metrics").status_code == 200


def test_404_405_413(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert exc.value.body["code"] == "model_not_found"
    assert_error(http.get("/v1/models/gpt-4"), 404, "model")
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/completions"), 405)
    assert_error(http.post("/v1/completions", json={"prompt": "x" * (MAX_BYTES + 1)}), 413)

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit must hold while the body streams in
        yield b'{"prompt": "'
        for _ in range(MAX_BYTES // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    assert_error(http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"}), 413)
    assert http.post("/v1/completions", json={"prompt": "x" * 1000, "max_tokens": 1}).status_code == 200


def test_503_queue_full_then_disconnects_abort(server: Server, client: openai.OpenAI) -> None:
    """Fill the batch and the queue with long streams, check the next request gets 503 + Retry-After, then
    drop every stream and watch the engine abort them all and free the KV pool."""
    wait_until(server, idle, "an idle engine")
    before = metrics(server)
    body = {"prompt": "Hello", "max_tokens": TINY_CONTEXT - 16, "temperature": 0, "stream": True, "ignore_eos": True}
    with ExitStack() as stack:
        hc = stack.enter_context(http_client(server))
        for _ in range(MAX_RUNNING + MAX_QUEUED):
            assert stack.enter_context(hc.stream("POST", "/v1/completions", json=body)).status_code == 200
        wait_until(server, lambda m: m["ember:num_requests_running"] == MAX_RUNNING
                   and m["ember:num_requests_waiting"] == MAX_QUEUED, "a full batch and queue")
        err = assert_error(resp := hc.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 503)
        assert resp.headers["Retry-After"] == "1" and err["type"] == "service_unavailable"
        with pytest.raises(openai.APIStatusError) as exc:
            client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], stream=True)
        assert exc.value.status_code == 503
    # every stream is closed now: all six are aborted and every KV slot is free again
    aborted = before["ember:num_aborted_requests_total"] + MAX_RUNNING + MAX_QUEUED
    after = wait_until(server, lambda m: idle(m) and m["ember:num_aborted_requests_total"] == aborted, "the aborts")
    key = 'ember:request_success_total{finish_reason="abort"}'
    assert after[key] == before[key] + MAX_RUNNING + MAX_QUEUED


def test_engine_that_cannot_start_exits_1(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(tmp_path / "missing"), "--port",
           str(free_port())]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "the engine failed to start" in done.stderr


def test_unexpected_errors_are_500s_that_keep_the_connection() -> None:
    """An exception no handler knows becomes OpenAI's 500 inside the app; before, Starlette re-raised it after
    answering, and uvicorn closed the connection (the next request on it was reset)."""
    import asyncio

    from fastapi import FastAPI

    from server.api.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    async def call() -> httpx.Response:
        # ASGITransport re-raises any exception that escapes the app: answering is not enough to pass.
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get("/boom")

    body = assert_error(asyncio.run(call()), 500)
    assert body["code"] == "internal_error" and "a bug" not in body["message"]
