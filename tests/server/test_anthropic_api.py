"""POST /v1/messages and /v1/messages/count_tokens through the official anthropic SDK, on a real server serving
SmolLM2 with an API key: plain, system, stop sequences, max_tokens, streaming (the SDK's own event parser),
forced tool use and a tool_result turn, errors in Anthropic's shape, x-api-key / Bearer auth, a client leaving
mid-stream (KV freed, seen in /metrics) and the per-route request counter."""
from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from server_harness import Server, idle, metrics, run_server, wait_until

pytestmark = pytest.mark.slow
KEY = "anthropic-test-key"
# "Answer in one sentence.": the bare question's first token is a near-tie between "The" and "L" (which goes on in
# French), and greedy takes "L" on some CPUs' numerics (see test_sampling_defaults.py); this way it says Paris.
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--disable-compile", "--max-total-tokens", "16384", "--max-running-requests", "4", "--api-key", KEY]
    with run_server(args, tmp_path_factory.mktemp("anthropic") / "server.log", timeout=300) as server:
        yield server


@pytest.fixture(scope="module")
def client(smol: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=smol.base_url, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(smol: Server) -> str:
    resp = httpx.get(smol.base_url + "/v1/models", headers={"x-api-key": KEY}, timeout=30)
    return str(resp.json()["data"][0]["id"])


# This SDK has no temperature argument any more (newer Claude models fix it); the API field stays, and Ember
# serves it: extra_body sends it.
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def _greedy(client: anthropic.Anthropic, model: str, **kw: Any) -> Any:
    return client.messages.create(model=model, **{"max_tokens": 32, "messages": QUESTION, **GREEDY, **kw})


def test_plain_message_and_count_tokens(client: anthropic.Anthropic, model: str) -> None:
    msg = _greedy(client, model, metadata={"user_id": "someone"})
    assert msg.type == "message" and msg.role == "assistant" and msg.model == model
    assert msg.id.startswith("msg_") and msg.content[0].type == "text"
    assert "Paris" in _text(msg)
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert 0 < msg.usage.output_tokens <= 32
    counted = client.messages.count_tokens(model=model, messages=QUESTION).input_tokens
    # Anthropic's input_tokens excludes the tokens read from the cache: together they are the whole prompt.
    assert counted == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    again = _greedy(client, model)  # the same prompt again: the prefix cache serves (nearly) all of it
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == counted
    assert _text(again) == _text(msg)


def test_system_prompt_as_string_or_blocks(client: anthropic.Anthropic, model: str) -> None:
    system = "You are a pirate. Answer every question like a pirate."
    as_string = _greedy(client, model, system=system)
    as_blocks = _greedy(client, model, system=[{"type": "text", "text": system}])
    assert _text(as_string) == _text(as_blocks)
    def count(system: Any) -> int:
        return client.messages.count_tokens(model=model, messages=QUESTION, system=system).input_tokens

    # (Without a system prompt SmolLM2's template adds its own default one, so "longer than none" proves nothing.)
    assert count(system) == count([{"type": "text", "text": system}]) < count(system + " Say arr a lot.")
    assert as_string.usage.input_tokens + as_string.usage.cache_read_input_tokens == count(system)


def test_stop_sequence_and_max_tokens(client: anthropic.Anthropic, model: str) -> None:
    full = _text(_greedy(client, model))
    stop = full.split()[2]
    cut = _greedy(client, model, stop_sequences=["NEVER-IN-THE-OUTPUT", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert _text(cut) == full[:full.index(stop)]
    short = _greedy(client, model, max_tokens=3)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def _events(smol: Server, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    with httpx.stream("POST", smol.base_url + "/v1/messages", json=body, headers={"x-api-key": KEY},
                      timeout=300) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    out = []
    for frame in raw.strip().split("\n\n"):
        name_line, data_line = frame.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        out.append((name, data))
    return out


def test_stream_equals_greedy_and_event_sequence(client: anthropic.Anthropic, smol: Server, model: str) -> None:
    expected = _greedy(client, model)
    with client.messages.stream(model=model, max_tokens=32, messages=QUESTION, **GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == _text(expected) == _text(final)
    assert final.stop_reason == expected.stop_reason and final.usage.output_tokens == expected.usage.output_tokens
    names = [n for n, _ in _events(smol, {"model": model, "max_tokens": 32, "temperature": 0, "stream": True,
                                          "messages": QUESTION})]
    deltas = len(names) - 6
    assert deltas > 0
    assert names == ["message_start", "ping", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]


def test_forced_tool_use_then_tool_result(client: anthropic.Anthropic, smol: Server, model: str) -> None:
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    kw: dict[str, Any] = {"model": model, "max_tokens": 64, **GREEDY, "tools": [WEATHER],
                          "tool_choice": {"type": "tool", "name": "get_weather"}, "messages": ask}
    msg = client.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    assert isinstance(uses[0].input, dict) and isinstance(uses[0].input["city"], str)
    with client.messages.stream(**kw) as stream:  # streamed: the same call, its input as input_json_delta
        final = stream.get_final_message()
    streamed_uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and [(u.name, u.input) for u in streamed_uses] == [
        (u.name, u.input) for u in uses]
    raw = {**{k: v for k, v in kw.items() if k != "extra_body"}, "temperature": 0, "stream": True}
    names = [n for n, _ in _events(smol, raw)]
    assert names[-5:] == ["content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                          "message_stop"]
    result = [{"type": "tool_result", "tool_use_id": uses[0].id, "content": [{"type": "text", "text": "18 C, sunny"}]}]
    turn = [*ask, {"role": "assistant", "content": [u.model_dump() for u in msg.content]},
            {"role": "user", "content": result}]
    answer = client.messages.create(model=model, max_tokens=32, tools=[WEATHER], messages=turn, **GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    with_result = client.messages.count_tokens(model=model, tools=[WEATHER], messages=turn).input_tokens
    assert with_result > client.messages.count_tokens(model=model, tools=[WEATHER], messages=ask).input_tokens
    as_string = [*turn[:2], {"role": "user", "content": [{**result[0], "content": "18 C, sunny"}]}]
    assert client.messages.count_tokens(model=model, tools=[WEATHER], messages=as_string).input_tokens == with_result


def _anthropic_error(body: object, kind: str) -> str:
    assert isinstance(body, dict) and body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    return str(body["error"]["message"])


def test_errors_in_anthropic_shape(client: anthropic.Anthropic, smol: Server, model: str) -> None:
    resp = httpx.post(smol.base_url + "/v1/messages", json={"model": model, "messages": QUESTION},
                      headers={"x-api-key": KEY}, timeout=30)
    assert resp.status_code == 400 and "max_tokens" in _anthropic_error(resp.json(), "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as bad_role:
        client.messages.create(model=model, max_tokens=8, messages=[{"role": "system", "content": "hi"}])  # type: ignore[list-item]
    assert "role" in _anthropic_error(bad_role.value.body, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as unknown_tool:
        client.messages.create(model=model, max_tokens=8, messages=QUESTION, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "no_such_tool"})
    assert "no_such_tool" in _anthropic_error(unknown_tool.value.body, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=model, messages=[{"role": "user", "content": [{"type": "image"}]}])  # type: ignore[list-item]
    with pytest.raises(anthropic.NotFoundError) as unknown_model:
        client.messages.create(model="gpt-4o", max_tokens=8, messages=QUESTION)
    _anthropic_error(unknown_model.value.body, "not_found_error")
    # A body declared over --max-request-bytes is refused before it is read, in Anthropic's shape too.
    with socket.create_connection(("127.0.0.1", int(smol.base_url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {10**12}\r\n\r\n".encode())
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    _anthropic_error(json.loads(payload), "request_too_large")
    # The OpenAI routes keep OpenAI's shape.
    openai_shaped = httpx.post(smol.base_url + "/v1/chat/completions", json={"messages": []},
                               headers={"x-api-key": KEY}, timeout=30)
    assert openai_shaped.status_code == 400 and set(openai_shaped.json()) == {"error"}


def test_refused_and_ignored_fields(client: anthropic.Anthropic, smol: Server, model: str) -> None:
    """The Messages API's fields in request_fields.RULES: one asking for what Ember lacks is a 400 in Anthropic's
    shape naming it, on both routes; the hints Claude Code sends are accepted without a warning line."""
    schema = {"type": "json_schema", "schema": {"type": "object"}}
    with pytest.raises(anthropic.BadRequestError) as fmt:
        client.messages.create(model=model, max_tokens=8, messages=QUESTION,
                               extra_body={"output_config": {"format": schema}})
    assert _anthropic_error(fmt.value.body, "invalid_request_error").startswith("output_config is not supported")
    with pytest.raises(anthropic.BadRequestError) as mcp:
        client.messages.count_tokens(model=model, messages=QUESTION, extra_body={"mcp_servers": [
            {"type": "url", "url": "https://mcp.example/sse", "name": "x"}]})
    assert "mcp_servers" in _anthropic_error(mcp.value.body, "invalid_request_error")
    hints = {"cache_control": {"type": "ephemeral"}, "service_tier": "auto", "output_config": {"effort": "low"},
             "context_management": {"edits": []}, "zz_unknown_field": 1}
    assert _text(_greedy(client, model, extra_body={**GREEDY["extra_body"], **hints})) == _text(_greedy(client, model))
    ignored = [line for line in smol.log().splitlines() if "ignored unknown fields" in line]
    assert ignored and ignored[-1].endswith("zz_unknown_field")  # the hints are known: only the unknown one is named


@pytest.mark.parametrize("name", ["claude-sonnet-4-5-20250929", "claude-haiku-4-5", "claude-opus-4-1"])
def test_claude_model_names_are_served(client: anthropic.Anthropic, smol: Server, model: str, name: str) -> None:
    """Claude Code sends Anthropic's model names: they get the served model, the response echoing the name."""
    expected = _greedy(client, model)
    msg = _greedy(client, name)
    assert msg.model == name and _text(msg) == _text(expected) and msg.usage.output_tokens > 0
    with client.messages.stream(model=name, max_tokens=32, messages=QUESTION, **GREEDY) as stream:
        assert "".join(stream.text_stream) == _text(expected)
        assert stream.get_final_message().model == name  # message_start names it
    counted = client.messages.count_tokens(model=name, messages=QUESTION).input_tokens
    assert counted == client.messages.count_tokens(model=model, messages=QUESTION).input_tokens
    # Only the Anthropic routes take them: the OpenAI routes keep their 404 for a name they do not serve.
    chat = httpx.post(smol.base_url + "/v1/chat/completions", json={"model": name, "messages": QUESTION},
                      headers={"x-api-key": KEY}, timeout=30)
    assert chat.status_code == 404


def test_other_unknown_model_names_are_404(client: anthropic.Anthropic) -> None:
    for name in ("gpt-4o", "claude", "Claude-sonnet-4", "sonnet"):  # no claude- prefix, as Anthropic spells it
        with pytest.raises(anthropic.NotFoundError) as unknown:
            client.messages.count_tokens(model=name, messages=QUESTION)
        assert name in _anthropic_error(unknown.value.body, "not_found_error")


def test_api_key_headers(smol: Server, model: str) -> None:
    with pytest.raises(anthropic.AuthenticationError) as wrong:
        anthropic.Anthropic(base_url=smol.base_url, api_key="wrong", max_retries=0).messages.count_tokens(
            model=model, messages=QUESTION)
    _anthropic_error(wrong.value.body, "authentication_error")
    missing = httpx.post(smol.base_url + "/v1/messages/count_tokens", json={"messages": QUESTION}, timeout=30)
    assert missing.status_code == 401
    _anthropic_error(missing.json(), "authentication_error")
    bearer = anthropic.Anthropic(base_url=smol.base_url, auth_token=KEY, max_retries=0)  # Authorization: Bearer
    assert bearer.messages.count_tokens(model=model, messages=QUESTION).input_tokens > 0
    # x-api-key is accepted on every route, the OpenAI ones included.
    models = httpx.get(smol.base_url + "/v1/models", headers={"x-api-key": KEY}, timeout=30)
    assert models.status_code == 200
    assert httpx.get(smol.base_url + "/v1/models", timeout=30).status_code == 401


def test_disconnect_mid_stream_frees_kv(smol: Server, model: str) -> None:
    wait_until(smol, idle, "an idle engine")
    before = metrics(smol)["ember:num_aborted_requests_total"]
    body = json.dumps({"model": model, "max_tokens": 4000, "temperature": 0, "stream": True, "messages": [
        {"role": "user", "content": "Count from 1 to 5000, one number per line, and never stop."}]}).encode()
    sock = socket.create_connection(("127.0.0.1", int(smol.base_url.rsplit(":", 1)[1])))
    sock.sendall(f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: {KEY}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_until(smol, lambda m: m["ember:num_requests_running"] == 1 and m["ember:kv_pool_used_slots"] > 0,
               "the request to run")
    sock.close()
    wait_until(smol, lambda m: idle(m) and m["ember:num_aborted_requests_total"] == before + 1, "the abort")


def test_requests_counted_by_route(client: anthropic.Anthropic, smol: Server, model: str) -> None:
    def count(route: str, status: int) -> float:
        return metrics(smol).get(f'ember:http_requests_total{{route="{route}",status="{status}"}}', 0.0)

    ok, bad = count("/v1/messages/count_tokens", 200), count("/v1/messages", 400)
    client.messages.count_tokens(model=model, messages=QUESTION)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=model, max_tokens=0, messages=QUESTION)
    assert count("/v1/messages/count_tokens", 200) == ok + 1
    assert count("/v1/messages", 400) == bad + 1
    httpx.get(smol.base_url + "/no/such/route", timeout=30)
    assert count("unmatched", 404) >= 1
