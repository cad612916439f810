"""Fuzzes the generation, tokenizer and embedding endpoints of a real `ember serve` (tiny random Llama) from the
API's own OpenAPI schema with schemathesis: no request may get a 5xx, every error is in OpenAI's shape, and afterwards the
server still answers, its log holds no traceback and its KV pool and queues are empty.

The server serves no /openapi.json (create_app sets openapi_url=None), so the schema is the one FastAPI builds for
the same app in this process. Three passes per operation, each a fixed number of derandomized cases: schema-valid
bodies, schema-invalid bodies, and (generation endpoints) schema-valid bodies steered into the engine's accepted
ranges, so that many of them reach the scheduler instead of stopping at a 400. EMBER_FUZZ_EXAMPLES=300 makes a
deeper run (~4 min on 2 cores) than the default 40 cases a pass (520 in all, ~35 s).

Requests go one at a time, and one asks for at most MAX_N (4) sequences, fewer than --max-running-requests plus
--max-queued-requests (6): the queue-full 503 cannot occur here, so every 503 is a failure too.
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import Case, GenerationMode

from conftest import MakeTinyModel
from server_harness import (
    API_KEY,
    TINY_CONTEXT,
    Server,
    greedy,
    idle,
    openai_client,
    run_server,
    tiny_server_args,
    wait_until,
)

FUZZED = ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/tokenize", "/v1/detokenize", "/v1/embeddings",
          "/v1/responses", "/v1/messages", "/v1/messages/count_tokens")
ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")  # errors in Anthropic's shape, streams end in message_stop
# Streams that end in a typed last event instead of OpenAI's `data: [DONE]`.
LAST_EVENT = {"/v1/responses": ("response.completed", "response.incomplete"), "/v1/messages": ("message_stop",)}
GENERATION = FUZZED[:3]
EXAMPLES = int(os.environ.get("EMBER_FUZZ_EXAMPLES", "40"))  # cases per operation and pass (more: a deeper run)
CONTEXT = 128  # --max-context-len: no generated max_tokens can make a case slow
MAX_OUTPUT = 24  # steered cases ask for at most this many tokens
EXPECTED = {200, 400, 404, 413}  # 404: a random "model"; 413: a body over --max-request-bytes
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def model_dir(make_tiny_model: MakeTinyModel) -> Path:
    return make_tiny_model("llama", max_position_embeddings=TINY_CONTEXT)


@pytest.fixture(scope="module")
def fuzz_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = [*tiny_server_args(model_dir), "--max-context-len", str(CONTEXT), "--max-total-tokens", str(8 * CONTEXT)]
    with run_server(args, tmp_path_factory.mktemp("fuzz") / "server.log") as server:
        yield server


def api_schema() -> schemathesis.BaseSchema:
    from engine.config import EngineConfig
    from server.api.app import create_app
    from server.api.settings import ServerSettings

    raw = create_app(EngineConfig(), ServerSettings()).openapi()  # builds no engine: that happens in the lifespan
    # Read every stream to its end (schemathesis stops after 20 events by default); ours have at most ~520.
    return schemathesis.openapi.from_dict(raw, config=schemathesis.Config.from_dict({"max-stream-events": 5000}))


# ---- steering: schema-valid bodies moved into the ranges the engine takes -----------------------------------
_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.05, 1.0), "min_p": (0.0, 1.0), "repetition_penalty": (0.5, 2.0),
           "frequency_penalty": (-2.0, 2.0), "presence_penalty": (-2.0, 2.0)}
_LENGTHS = {"max_tokens": MAX_OUTPUT, "max_completion_tokens": MAX_OUTPUT, "max_new_tokens": MAX_OUTPUT,
            "min_tokens": 4, "min_new_tokens": 4, "top_k": 50, "logprobs": 5, "top_logprobs": 5, "top_logprobs_num": 5}
_PROMPTS = {"prompt", "text", "input_ids"}


def _prompt(value: Any, vocab: int) -> Any:
    """Token ids into the vocabulary, texts short and non-empty, at most 2 prompts (n * prompts <= MAX_N)."""
    if isinstance(value, str):
        return value[:16] or "hello"
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) % vocab
    if isinstance(value, list):
        single = bool(value) and isinstance(value[0], int)
        return [_prompt(v, vocab) for v in (value[:16] if single else value[:2])]
    return value


def _message(message: Any) -> Any:
    if isinstance(message, dict):
        content = message.get("content")
        if isinstance(content, str):
            message["content"] = content[:16]
        elif isinstance(content, list):
            message["content"] = [{**part, "text": part["text"][:16]} if isinstance(part, dict)
                                  and isinstance(part.get("text"), str) else part for part in content[:2]]
        for call in message.get("tool_calls") or ():
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                call["function"]["arguments"] = "{}"
    return message


def _steer_fields(fields: dict[str, Any], vocab: int) -> None:
    for key, value in list(fields.items()):
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if key in _RANGES and number:
            lo, hi = _RANGES[key]
            fields[key] = lo + abs(value) % (hi - lo)
        elif key in _LENGTHS and number and isinstance(value, int):
            fields[key] = abs(value) % (_LENGTHS[key] + 1)
        elif key == "n" and number and isinstance(value, int):
            fields[key] = 1 + abs(value) % 2
        elif key in _PROMPTS:
            fields[key] = _prompt(value, vocab)
        elif key == "messages" and isinstance(value, list):
            fields[key] = [_message(m) for m in value[:3]]
        elif key == "tools" and isinstance(value, list):
            fields[key] = value[:1]  # every tool's schema goes into the prompt
        elif key == "stop_token_ids" and isinstance(value, list):
            fields[key] = [_prompt(v, vocab) for v in value]
        elif key == "logit_bias" and isinstance(value, dict):
            fields[key] = {str(k % vocab): max(-100.0, min(100.0, v)) for k, v in enumerate(value.values())
                           if isinstance(v, int | float) and not isinstance(v, bool)}
        elif key == "sampling_params" and isinstance(value, dict):
            _steer_fields(value, vocab)
    for key in ("max_tokens", "max_completion_tokens", "max_new_tokens"):
        if fields.get(key) == 0:
            fields[key] = 1


def steered(vocab: int) -> Callable[[Case], Case]:
    def steer(case: Case) -> Case:
        if isinstance(case.body, dict):
            body = json.loads(json.dumps(case.body))
            _steer_fields(body, vocab)
            if case.path == "/generate":
                if (body.get("text") is None) == (body.get("input_ids") is None):
                    body.pop("input_ids", None)
                    body["text"] = body.get("text") or "hello"
                sampling = body.setdefault("sampling_params", {})
                if isinstance(sampling, dict) and sampling.get("max_new_tokens") is None:
                    sampling["max_new_tokens"] = MAX_OUTPUT  # SGLang's default, 128, is the whole context
            case.body = body
        return case

    return steer


# ---- what every response must look like ----------------------------------------------------------------------
def _error_shape_ok(body: object, path: str) -> bool:
    if path in ANTHROPIC:  # {"type": "error", "error": {"type": ..., "message": ...}}
        return (isinstance(body, dict) and body.get("type") == "error" and isinstance(body.get("error"), dict)
                and {"type", "message"} <= set(body["error"]))
    return (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict)
            and set(body["error"]) == ERROR_KEYS)


def _stream_problem(response: schemathesis.Response, path: str) -> str | None:
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    if response.stream_cut_short or not events:
        return "stream cut short or empty"
    last = LAST_EVENT.get(path)
    if last is None and events[-1] != "[DONE]":
        return "stream does not end with [DONE]"
    try:
        chunks = [json.loads(e) for e in (events if last else events[:-1])]
    except ValueError:
        return "stream event is not JSON"
    if last is not None and not (isinstance(chunks[-1], dict) and chunks[-1].get("type") in last):
        return f"stream does not end with {' or '.join(last)}"
    if any("error" in c or c.get("type") in ("error", "response.failed") for c in chunks if isinstance(c, dict)):
        return "error event inside a 200 stream"
    return None


def problem_with(response: schemathesis.Response, path: str) -> str | None:
    """Why this response breaks the contract, or None."""
    status = response.status_code
    if status not in EXPECTED:
        return f"status {status}"
    if status >= 400:
        try:
            body = response.json()
        except ValueError:
            return "error body is not JSON"
        if not _error_shape_ok(body, path):
            return f"error body not in {'Anthropic' if path in ANTHROPIC else 'OpenAI'}'s shape"
        return "traceback in the error body" if "Traceback" in response.text else None
    content_type = next((v[0] for k, v in response.headers.items() if k.lower() == "content-type" and v), "")
    if content_type.startswith("text/event-stream"):
        return _stream_problem(response, path)
    try:
        response.json()
    except ValueError:
        return "200 body is not JSON"
    return None


def fuzz(server: Server, schema: schemathesis.BaseSchema, path: str, mode: GenerationMode,
         steer: Callable[[Case], Case] | None, problems: list[str]) -> Counter[int]:
    """Send EXAMPLES derandomized cases of POST `path`, noting each broken contract in `problems`; returns how
    many responses had each status."""
    strategy = schema[path]["POST"].as_strategy(generation_mode=mode)
    statuses: Counter[int] = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy.map(steer) if steer is not None else strategy)
    def send(case: Case) -> None:
        response = case.call(base_url=server.base_url, session=session, timeout=60)
        statuses[response.status_code] += 1
        why = problem_with(response, path)
        if why is not None:
            problems.append(f"POST {path} ({mode.value}{', steered' if steer else ''}): {why}\n"
                            f"  body: {json.dumps(case.body, default=repr)[:1500]}\n  response: {response.text[:400]}")

    with requests.Session() as session:
        session.headers["Authorization"] = f"Bearer {API_KEY}"
        send()
    return statuses


def first_traceback(log: str) -> str:
    """The end of the first traceback in a server log: the route's frames and the exception."""
    start = log.find("Traceback")
    if start < 0:
        return "(none)"
    end = log.find("\n20", start)  # the next log line starts with its date
    return log[start:end if end > 0 else len(log)][-2500:]


def test_fuzzed_requests_never_break_the_server(fuzz_server: Server, model_dir: Path) -> None:
    schema = api_schema()
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    problems: list[str] = []
    tally: dict[str, Counter[int]] = {}
    started = time.monotonic()
    for path in FUZZED:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            tally[f"{path} {mode.value}"] = fuzz(fuzz_server, schema, path, mode, None, problems)
        if path in GENERATION:
            tally[f"{path} steered"] = fuzz(fuzz_server, schema, path, GenerationMode.POSITIVE, steered(vocab),
                                            problems)
    sent, elapsed = sum(sum(c.values()) for c in tally.values()), time.monotonic() - started
    summary = "\n".join(f"  {name}: {dict(sorted(c.items()))}" for name, c in tally.items())
    print(f"{sent} cases in {elapsed:.0f} s:\n{summary}")
    assert not problems, (f"{len(problems)} of {sent} cases broke the contract:\n" + "\n".join(problems[:8])
                          + f"\nfirst traceback in the server log (its end):\n{first_traceback(fuzz_server.log())}")
    # The steering must keep working as the schema grows: many steered cases reach the engine.
    for path in GENERATION:
        steered_ok = tally[f"{path} steered"]
        assert steered_ok[200] >= EXAMPLES // 4, f"steered {path} cases mostly refused:\n{summary}"

    # The server is unharmed: it drains, answers a normal request, and logged no traceback.
    wait_until(fuzz_server, idle, "the KV pool and queues to drain after the fuzz", timeout=60)
    answer = greedy(openai_client(fuzz_server), "Once upon a time", max_tokens=8)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 8
    wait_until(fuzz_server, idle, "the KV pool and queues to drain after the last request")
    assert "Traceback" not in fuzz_server.log(), fuzz_server.log()[-6000:]

