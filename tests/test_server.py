"""The HTTP server end to end: a real `ember serve` subprocess on a free port, driven by the official `openai`
client (and raw HTTP where the wire format itself is under test).

Most tests share one server over a tiny random Llama (eager, float32, API key on, small limits so every error
class is reachable). Separate servers cover compile-on with SIGTERM drain, and SmolLM2's real answer.
"""
from __future__ import annotations

import json
import re
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from server_fixtures import Server, make_tiny_llama, run_server

API_KEY = "test-key"
MAX_RUNNING, MAX_QUEUED, MAX_N, MAX_BYTES = 4, 2, 4, 65536
LONG = {"ignore_eos": True}  # extra_body: random weights may emit EOS at any step; these tests need lengths


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--model", str(tiny_model), "--dtype", "float32", "--disable-compile", "--max-total-tokens", "32768",
            "--max-running-requests", str(MAX_RUNNING), "--max-queued-requests", str(MAX_QUEUED),
            "--max-n", str(MAX_N), "--max-request-bytes", str(MAX_BYTES), "--api-key", API_KEY]
    with run_server(args, tmp_path_factory.mktemp("logs") / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


# ---- helpers ----------------------------------------------------------------------------------------------
def metrics(server: Server) -> dict[str, float]:
    """`name{labels}` -> value of every sample on /metrics."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def wait_until(server: Server, cond: Callable[[dict[str, float]], bool], what: str, timeout: float = 20.0) -> dict[str, float]:
    """Poll /metrics until `cond` holds (bounded); returns the metrics that satisfied it."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if cond(m):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last metrics: "
                                 f"{ {k: v for k, v in m.items() if 'num_' in k or 'kv_pool' in k} }")
        time.sleep(0.02)


def idle(m: dict[str, float]) -> bool:
    return (m["ember:kv_pool_used_slots"] == 0 and m["ember:num_requests_running"] == 0
            and m["ember:num_requests_waiting"] == 0)


def sse_events(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: "):]


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in resp.text
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


def greedy(client: openai.OpenAI, prompt: str | list[int], max_tokens: int = 24, **extra: object):
    return client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={**LONG, **extra})


# ---- completions and chat ---------------------------------------------------------------------------------
def test_completion_usage_and_stream_match(client: openai.OpenAI, http: httpx.Client) -> None:
    prompt = "The capital of France is"
    res = greedy(client, prompt)
    n_prompt = http.post("/v1/tokenize", json={"prompt": prompt}).json()["count"]
    assert res.object == "text_completion" and res.model == "tiny-llama"
    assert res.usage.prompt_tokens == n_prompt and res.usage.completion_tokens == 24
    assert res.usage.total_tokens == n_prompt + 24
    assert res.choices[0].finish_reason == "length" and res.choices[0].text
    chunks = list(client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body=LONG))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == res.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # the same prompt as token ids gives the same completion
    ids = http.post("/v1/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert greedy(client, ids).choices[0].text == res.choices[0].text


def test_chat_stream_role_first_done_last(client: openai.OpenAI, http: httpx.Client) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    full = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=16, temperature=0,
                                          extra_body=LONG)
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 16
    rendered = http.post("/v1/tokenize", json={"messages": messages}).json()["count"]
    assert full.usage.prompt_tokens == rendered
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == full.choices[0].message.content
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
    assert all(c["usage"] is None for c in chunks[:-1])


def test_stop_strings_and_stop_token_ids(client: openai.OpenAI, http: httpx.Client) -> None:
    prompt = "Once upon a time"
    base = greedy(client, prompt, max_tokens=30)
    text = base.choices[0].text
    stop = text[10:13]
    cut = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=30, temperature=0, stop=[stop],
                                    extra_body=LONG)
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    ids = http.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 30, "temperature": 0,
                                                                        "ignore_eos": True}}).json()["output_ids"]
    target = ids[5]
    by_id = greedy(client, prompt, max_tokens=30, stop_token_ids=[target])
    assert by_id.choices[0].finish_reason == "stop"
    assert by_id.usage.completion_tokens == ids.index(target) + 1


def test_n_and_seeds(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        res = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=12, temperature=1.0, n=3,
                                        seed=seed, extra_body=LONG)
        assert sorted(c.index for c in res.choices) == [0, 1, 2] and res.usage.completion_tokens == 36
        return [c.text for c in sorted(res.choices, key=lambda c: c.index)]

    first = sample(1234)
    assert sample(1234) == first  # reproducible
    assert len(set(first)) > 1  # the n choices are different samples
    assert sample(99) != first
    chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}], n=2,
                                          max_tokens=8, temperature=1.0, seed=7, extra_body=LONG)
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 16


def test_multiple_prompts_and_echo(client: openai.OpenAI) -> None:
    res = client.completions.create(model="tiny-llama", prompt=["Hello world", "a quick brown fox"], n=2,
                                    max_tokens=6, temperature=0, echo=True, extra_body=LONG)
    assert [c.index for c in sorted(res.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in res.choices}
    assert by_index[0].startswith("Hello world") and by_index[2].startswith("a quick brown fox")
    assert by_index[0] == by_index[1]  # greedy: both choices of a prompt agree
    single = greedy(client, "a quick brown fox", max_tokens=6)
    assert by_index[2] == "a quick brown fox" + single.choices[0].text
    assert res.usage.completion_tokens == 24


def test_logprobs_both_formats(client: openai.OpenAI) -> None:
    res = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=8, temperature=0, logprobs=3,
                                    extra_body=LONG)
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the best
    assert lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, extra_body=LONG)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        assert len(item.top_logprobs) == 2 and item.bytes == list(item.token.encode())
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    stream = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                                            stream=True, extra_body=LONG)
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_models_and_native_endpoints(client: openai.OpenAI, http: httpx.Client) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    assert client.models.retrieve("tiny-llama").id == "tiny-llama"
    ids = http.post("/v1/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert http.post("/v1/detokenize", json={"tokens": ids}).json()["prompt"] == "Hello world"
    sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    out = http.post("/generate", json={"text": "Hello world", "sampling_params": sp}).json()
    assert len(out["output_ids"]) == 10 and out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["text"] == greedy(client, "Hello world", max_tokens=10).choices[0].text
    assert http.post("/generate", json={"input_ids": ids, "sampling_params": sp}).json()["output_ids"] == out["output_ids"]
    with http.stream("POST", "/generate", json={"text": "Hello world", "sampling_params": sp, "stream": True}) as r:
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["text"] == out["text"] and last["output_ids"] == out["output_ids"]  # cumulative, SGLang-style
    info = http.get("/get_server_info").json()
    assert info["model"] == "tiny-llama" and info["kv_pool_slots"] == 32768 and info["decode_buckets"] == [1, 2, 4]
    assert info["dtype"] == "float32" and info["versions"]["torch"]
    assert http.get("/health_generate").status_code == 200


# ---- errors -----------------------------------------------------------------------------------------------
def test_400_invalid_fields_in_openai_shape(client: openai.OpenAI, http: httpx.Client) -> None:
    assert_error(http.post("/v1/completions", json={"prompt": "x", "temperature": "hot"}), 400, "temperature")
    assert_error(http.post("/v1/completions", json={"prompt": "x", "temperature": -1}), 400, "temperature")
    assert_error(http.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    assert_error(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_error(http.post("/v1/completions", json={"prompt": [999999]}), 400, "prompt")
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=8, top_p=0)
    assert exc.value.status_code == 400 and exc.value.body["param"] == "top_p"


def test_400_over_context_and_n_over_limit(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=40000)
    assert exc.value.body["param"] == "max_tokens" and exc.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc:  # streaming requests are refused before the 200
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=40000, stream=True)
    assert exc.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=2, n=MAX_N + 1)
    assert exc.value.body["param"] == "n"


def test_401_auth(server: Server) -> None:
    for key in (None, "wrong-key"):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        err = assert_error(httpx.get(server.base_url + "/v1/models", headers=headers), 401)
        assert err["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny-llama", prompt="x", max_tokens=2)
    assert httpx.get(server.base_url + "/health").status_code == 200  # probes stay open
    assert httpx.get(server.base_url + "/metrics").status_code == 200


def test_404_405_413(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert exc.value.body["code"] == "model_not_found"
    assert_error(http.get("/v1/models/gpt-4"), 404, "model")
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/completions"), 405)
    big = "x" * (MAX_BYTES + 1)
    assert_error(http.post("/v1/completions", json={"prompt": big}), 413)

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit must hold while the body streams in
        yield b'{"prompt": "'
        for _ in range(MAX_BYTES // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    assert_error(http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"}), 413)


def test_503_queue_full_then_disconnects_abort(server: Server, client: openai.OpenAI) -> None:
    """Fill the batch and the queue with long streams, check the next request gets 503 + Retry-After, then
    drop every stream and watch the engine abort them all and free the KV pool."""
    wait_until(server, idle, "an idle engine")
    before = metrics(server)
    body = {"prompt": "Hello", "max_tokens": 3500, "temperature": 0, "stream": True, "ignore_eos": True}
    with ExitStack() as stack:
        hc = stack.enter_context(httpx.Client(base_url=server.base_url, timeout=30,
                                              headers={"Authorization": f"Bearer {API_KEY}"}))
        for _ in range(MAX_RUNNING + MAX_QUEUED):
            r = stack.enter_context(hc.stream("POST", "/v1/completions", json=body))
            assert r.status_code == 200
        wait_until(server, lambda m: m["ember:num_requests_running"] == MAX_RUNNING
                   and m["ember:num_requests_waiting"] == MAX_QUEUED, "a full batch and queue")
        resp = httpx.post(server.base_url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"prompt": "x", "max_tokens": 2})
        assert_error(resp, 503)
        assert resp.headers["Retry-After"] == "1"
        with pytest.raises(openai.APIStatusError) as exc:
            client.completions.create(model="tiny-llama", prompt="x", max_tokens=2)
        assert exc.value.status_code == 503
    # every stream is closed now: all six must be aborted and every KV slot freed
    after = wait_until(server, lambda m: idle(m) and m["ember:num_aborted_requests_total"]
                       >= before["ember:num_aborted_requests_total"] + MAX_RUNNING + MAX_QUEUED, "aborts")
    assert after['ember:request_success_total{finish_reason="abort"}'] >= 6


def _raw_post(server: Server, path: str, body: dict) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", int(server.base_url.rsplit(":", 1)[1])))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_aborts_and_frees_kv(server: Server, stream: bool) -> None:
    wait_until(server, idle, "an idle engine")
    before = metrics(server)["ember:num_aborted_requests_total"]
    sock = _raw_post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": 3500, "ignore_eos": True, "stream": stream})
    wait_until(server, lambda m: m["ember:num_requests_running"] == 1 and m["ember:kv_pool_used_slots"] > 0,
               "the request to run")
    sock.close()
    wait_until(server, lambda m: idle(m) and m["ember:num_aborted_requests_total"] == before + 1, "the abort")


def test_concurrent_streams_complete_and_correct(client: openai.OpenAI) -> None:
    prompts = [f"Request number {i} says hello" for i in range(MAX_RUNNING + MAX_QUEUED)]
    expected = [greedy(client, p, max_tokens=40).choices[0].text for p in prompts]
    results: dict[int, tuple[str, str | None]] = {}

    def run(i: int) -> None:
        stream = client.completions.create(model="tiny-llama", prompt=prompts[i], max_tokens=40, temperature=0,
                                           stream=True, extra_body=LONG)
        chunks = list(stream)
        results[i] = ("".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert {i: r for i, r in results.items()} == {i: (e, "length") for i, e in enumerate(expected)}


def test_health_is_fast_during_decode(server: Server) -> None:
    body = {"prompt": "Hello", "max_tokens": 2000, "temperature": 0, "stream": True, "ignore_eos": True}
    latencies = []
    with httpx.Client(base_url=server.base_url, timeout=30, headers={"Authorization": f"Bearer {API_KEY}"}) as hc:
        with ExitStack() as stack:
            for _ in range(MAX_RUNNING):
                stack.enter_context(hc.stream("POST", "/v1/completions", json=body))
            wait_until(server, lambda m: m["ember:num_requests_running"] == MAX_RUNNING, "a full decode batch")
            with httpx.Client(base_url=server.base_url, timeout=5) as probe:
                for _ in range(20):
                    t0 = time.perf_counter()
                    assert probe.get("/health").status_code == 200
                    latencies.append(time.perf_counter() - t0)
            assert metrics(server)["ember:num_requests_running"] == MAX_RUNNING  # still decoding throughout
    print("health latencies ms", sorted(round(x * 1000, 1) for x in latencies))
    assert statistics.median(latencies) < 0.1, latencies
    assert max(latencies) < 0.1, latencies


def test_metrics_exposed(server: Server, client: openai.OpenAI) -> None:
    greedy(client, "Hello", max_tokens=4)
    text = httpx.get(server.base_url + "/metrics").text
    for name in ("ember:num_requests_running", "ember:num_requests_waiting", "ember:kv_pool_usage_perc",
                 "ember:kv_pool_total_slots", "ember:prompt_tokens_total", "ember:generation_tokens_total",
                 'ember:request_success_total{finish_reason="length"}', "ember:num_aborted_requests_total",
                 "ember:num_retractions_total", "ember:time_to_first_token_seconds_bucket",
                 "ember:inter_token_latency_seconds_bucket", "ember:e2e_request_latency_seconds_bucket",
                 "ember:request_queue_time_seconds_bucket", 'ember:decode_steps_total{bucket="1"}',
                 'ember:compile_seconds{bucket="4"}'):
        assert name in text, name
    assert re.search(r"^ember:kv_pool_total_slots 32768", text, re.M)


def test_request_log_line(server: Server, client: openai.OpenAI) -> None:
    res = greedy(client, "Hello", max_tokens=5)
    pattern = rf"request {res.id} finished: prompt_tokens=\d+ output_tokens=5 ttft=[\d.]+s tokens/s=[\d.]+ " \
              r"finish_reason=length"
    deadline = time.monotonic() + 10
    while not re.search(pattern, server.log()):
        assert time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.05)


# ---- separate servers: compiled decode + SIGTERM drain; the real SmolLM2 ----------------------------------
def _read_stream(resp: httpx.Response) -> tuple[str, str | None, list[str]]:
    events = list(sse_events(resp.iter_lines()))
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    return text, reasons[-1] if reasons else None, events


def test_compiled_server_matches_eager_and_drains_on_sigterm(tiny_model: Path, client: openai.OpenAI,
                                                              tmp_path: Path) -> None:
    """One compiled bucket; same greedy text as the eager server. Then SIGTERM while one request runs and one
    waits: /health and new requests get 503, the running one finishes, the waiting one (too long for the grace
    period) ends with finish_reason abort, and the process exits 0."""
    eager = greedy(client, "The capital of France is", max_tokens=40).choices[0].text
    args = ["--model", str(tiny_model), "--dtype", "float32", "--max-total-tokens", "32768",
            "--max-running-requests", "1", "--shutdown-grace-seconds", "4"]
    with run_server(args, tmp_path / "compiled.log") as srv, httpx.Client(base_url=srv.base_url, timeout=60) as hc:
        assert http_completion(hc, "The capital of France is", 40) == eager
        assert hc.get("/get_server_info").json()["compiled"] is True
        short = {"prompt": "Hello", "max_tokens": 100, "temperature": 0, "stream": True, "ignore_eos": True}
        long = {**short, "max_tokens": 16000}  # cannot finish within the grace period on any machine
        with hc.stream("POST", "/v1/completions", json=short) as a, hc.stream("POST", "/v1/completions", json=long) as b:
            wait_until(srv, lambda m: m["ember:num_requests_waiting"] == 1, "the long request to queue")
            srv.proc.send_signal(15)
            deadline = time.monotonic() + 10
            while httpx.get(srv.base_url + "/health").status_code != 503:
                assert time.monotonic() < deadline, "health never turned 503"
            assert_error(httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}), 503)
            text_a, reason_a, _ = _read_stream(a)
            text_b, reason_b, events_b = _read_stream(b)
        assert reason_a == "length" and text_a
        assert reason_b == "abort" and events_b[-1] == "[DONE]"
        assert srv.proc.wait(30) == 0
    assert "draining: 2 requests in flight" in srv.log()


def http_completion(hc: httpx.Client, prompt: str, max_tokens: int) -> str:
    r = hc.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.slow
def test_smollm2_answers_paris(tmp_path: Path) -> None:
    args = ["--dtype", "float32", "--disable-compile", "--max-total-tokens", "4096", "--max-running-requests", "1"]
    with run_server(args, tmp_path / "smollm2.log", timeout=300) as srv:
        smol = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = smol.models.list().data[0].id
        res = smol.chat.completions.create(model=model, temperature=0, max_tokens=30,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in res.choices[0].message.content, res.choices[0].message.content
        streamed = smol.chat.completions.create(model=model, temperature=0, max_tokens=30, stream=True,
                                                messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == res.choices[0].message.content
