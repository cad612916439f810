"""The OpenAI-compatible and native APIs, end to end through the official `openai` client (raw HTTP where the
wire format itself is under test): completions and chat, streaming and not, usage, stop, n, seeds, echo,
logprobs, models, /generate, tokenize, metrics and the per-request log line."""
from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from server_harness import (
    LONG,
    MODEL_NAME,
    TINY_CONTEXT,
    Server,
    greedy,
    metrics,
    read_completion_stream,
    sse_events,
)


def test_completion_usage_and_stream_match(client: openai.OpenAI, http: httpx.Client) -> None:
    prompt = "The capital of France is"
    res = greedy(client, prompt)
    n_prompt = http.post("/v1/tokenize", json={"prompt": prompt}).json()["count"]
    assert res.object == "text_completion" and res.model == MODEL_NAME
    assert res.usage.prompt_tokens == n_prompt and res.usage.completion_tokens == 24
    assert res.usage.total_tokens == n_prompt + 24
    assert res.choices[0].finish_reason == "length" and res.choices[0].text
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body=LONG))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == res.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    with http.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                                       "stream": True, "ignore_eos": True}) as r:
        text, reason, events = read_completion_stream(r)
    assert (text, reason, events[-1]) == (res.choices[0].text, "length", "[DONE]")
    assert all('"usage"' not in e for e in events)  # no usage unless stream_options asks for it
    ids = http.post("/v1/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert greedy(client, ids).choices[0].text == res.choices[0].text  # token-id prompts


def test_chat_stream_role_first_done_last(client: openai.OpenAI, http: httpx.Client) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0,
                                          extra_body=LONG)
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 16
    assert full.usage.prompt_tokens == http.post("/v1/tokenize", json={"messages": messages}).json()["count"]
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert len({c["created"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == full.choices[0].message.content
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
    assert all(c["usage"] is None for c in chunks[:-1])


def test_stop_strings_and_stop_token_ids(client: openai.OpenAI, http: httpx.Client) -> None:
    prompt = "Once upon a time"
    text = greedy(client, prompt, max_tokens=30).choices[0].text
    stop = text[10:13]
    cut = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=30, temperature=0, stop=[stop],
                                    extra_body=LONG)
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    sp = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    ids = http.post("/generate", json={"text": prompt, "sampling_params": sp}).json()["output_ids"]
    by_id = greedy(client, prompt, max_tokens=30, stop_token_ids=[ids[5]])
    assert by_id.choices[0].finish_reason == "stop"
    assert by_id.usage.completion_tokens == ids.index(ids[5]) + 1


def test_n_and_seeds(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        res = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=12, temperature=1.0, n=3,
                                        seed=seed, extra_body=LONG)
        assert sorted(c.index for c in res.choices) == [0, 1, 2] and res.usage.completion_tokens == 36
        return [c.text for c in sorted(res.choices, key=lambda c: c.index)]

    first = sample(1234)
    assert sample(1234) == first  # reproducible
    assert len(set(first)) > 1  # the n choices are different samples
    assert sample(99) != first
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], n=2,
                                          max_tokens=8, temperature=1.0, seed=7, extra_body=LONG)
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 16


def test_multiple_prompts_and_echo(client: openai.OpenAI) -> None:
    res = client.completions.create(model=MODEL_NAME, prompt=["Hello world", "a quick brown fox"], n=2,
                                    max_tokens=6, temperature=0, echo=True, extra_body=LONG)
    by_index = {c.index: c.text for c in res.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert by_index[0].startswith("Hello world") and by_index[0] == by_index[1]  # greedy: both choices agree
    assert by_index[2] == "a quick brown fox" + greedy(client, "a quick brown fox", max_tokens=6).choices[0].text
    assert res.usage.completion_tokens == 24


def test_logprobs_both_formats(client: openai.OpenAI, http: httpx.Client) -> None:
    res = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=8, temperature=0, logprobs=3,
                                    extra_body=LONG)
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the best
    assert lp.text_offset == sorted(lp.text_offset)
    body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "logprobs": 3, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(e) for e in sse_events(r.iter_lines())[:-1]]
    streamed = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(lp.token_logprobs)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, extra_body=LONG)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        assert len(item.top_logprobs) == 2 and item.bytes == list(item.token.encode())
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                                            stream=True, extra_body=LONG)
    streamed_tokens = [t.token for c in stream if c.choices and c.choices[0].logprobs
                       for t in c.choices[0].logprobs.content]
    assert streamed_tokens == [t.token for t in content]


def test_models_and_native_endpoints(client: openai.OpenAI, http: httpx.Client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    ids = http.post("/v1/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert http.post("/v1/detokenize", json={"tokens": ids}).json()["prompt"] == "Hello world"
    sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    out = http.post("/generate", json={"text": "Hello world", "sampling_params": sp}).json()
    assert len(out["output_ids"]) == 10 and out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["text"] == greedy(client, "Hello world", max_tokens=10).choices[0].text
    by_ids = http.post("/generate", json={"input_ids": ids, "sampling_params": sp}).json()
    assert by_ids["output_ids"] == out["output_ids"]
    with http.stream("POST", "/generate", json={"text": "Hello world", "sampling_params": sp, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["text"] == out["text"] and last["output_ids"] == out["output_ids"]  # cumulative, SGLang-style
    info = http.get("/get_server_info").json()
    assert info["model"] == MODEL_NAME and info["kv_pool_slots"] == 2 * TINY_CONTEXT
    assert info["decode_buckets"] == [1, 2, 4] and info["dtype"] == "float32" and info["versions"]["torch"]
    # --kv-cache-dtype auto: the serving dtype; K and V of 2 layers x 2 KV heads x 16 dims in fp32
    assert info["kv_cache"] == {"dtype": "float32", "bytes_per_token": 2 * 2 * 2 * 16 * 4}
    assert http.get("/health_generate").status_code == 200


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
    assert re.search(rf"^ember:kv_pool_total_slots {2 * TINY_CONTEXT}", text, re.M)


def test_request_log_line(server: Server, client: openai.OpenAI) -> None:
    res = greedy(client, "Hello", max_tokens=5)
    pattern = (rf"request {res.id} finished: prompt_tokens=\d+ output_tokens=5 ttft=[\d.]+s tokens/s=[\d.]+ "
               r"finish_reason=length")
    deadline = time.monotonic() + 10
    while not re.search(pattern, server.log()):  # the log is written by another process: bounded poll
        assert time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.05)


def test_repeated_prompt_reports_cached_tokens_and_flush_cache(server: Server, client: openai.OpenAI,
                                                               http: httpx.Client) -> None:
    """The prefix cache through the API: usage.prompt_tokens_details.cached_tokens (chat, completions, the
    usage chunk of a stream), /generate's meta_info.cached_tokens, the metrics, and POST /flush_cache."""
    assert http.post("/flush_cache").status_code == 200
    messages = [{"role": "system", "content": "You are a terse assistant. " * 20},
                {"role": "user", "content": "Name a prime number."}]
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0,
                                           extra_body=LONG)
    n_prompt = first.usage.prompt_tokens
    assert n_prompt > 100 and first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0,
                                           extra_body=LONG)
    assert again.usage.prompt_tokens_details.cached_tokens == n_prompt - 1  # the last token is recomputed
    assert again.choices[0].message.content == first.choices[0].message.content
    turn2 = [*messages, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Another one."}]
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=turn2, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=LONG))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= n_prompt - 1  # the system prompt, at least
    ids = http.post("/v1/tokenize", json={"messages": messages}).json()["tokens"]
    meta = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}).json()
    assert meta["meta_info"]["cached_tokens"] == n_prompt - 1
    m = metrics(server)
    assert m["ember:prefix_cache_hit_tokens_total"] >= 3 * (n_prompt - 1)
    assert 0 < m["ember:prefix_cache_hit_rate"] < 1 and m["ember:prefix_cache_slots"] >= n_prompt
    assert m["ember:kv_pool_used_slots"] == 0  # cached entries are not held by anyone
    flushed = http.post("/flush_cache").json()
    assert flushed == {"flushed_slots": m["ember:prefix_cache_slots"], "cached_slots": 0}
    assert metrics(server)["ember:prefix_cache_slots"] == 0
    after = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0,
                                           extra_body=LONG)
    assert after.usage.prompt_tokens_details.cached_tokens == 0
    assert after.choices[0].message.content == first.choices[0].message.content
