"""The soak's client side (scripts/soak.py): the requests its client threads send, and one attempt at each,
classified by what came back (ok, aborted, a documented 4xx or 503, a fault, or an invalid answer)."""
from __future__ import annotations

import json
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
from router_harness import Replica
from server_harness import API_KEY, MODEL_NAME

GREEDY_MAX_TOKENS = 32
DOCUMENTED_503 = {"draining", "service_unavailable"}
# Characters that occur nowhere in the tiny tokenizer's training corpus: no BPE merge joins them, so each is one
# token there. With another model the size is calibrated against its tokenizer anyway (long_prompt_chars).
LONG_ALPHABET = "BCDGJKLMNQRSUVWXYZ"


# ---- requests ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GreedySpec:
    key: str
    path: str
    body: dict[str, Any]


def greedy_specs() -> list[GreedySpec]:
    """The fixed prompts whose outputs must not depend on what else runs (batching, routing, prefix cache)."""
    base = {"model": MODEL_NAME, "max_tokens": GREEDY_MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    prompts = ["Hello", "The capital of France is", "a quick brown fox " * 4,
               "Once upon a time there was a small model that answered questions. " * 6,
               " ".join(f"item{i}" for i in range(60)), "0123456789 " * 20]
    specs = [GreedySpec(f"cmpl{i}", "/v1/completions", {**base, "prompt": p}) for i, p in enumerate(prompts)]
    chats = [[{"role": "user", "content": "Hi there"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How are you today?"}],
             [{"role": "user", "content": "Tell me a story about a lazy dog. " * 5}]]
    specs += [GreedySpec(f"chat{i}", "/v1/chat/completions", {**base, "messages": m}) for i, m in enumerate(chats)]
    specs.append(GreedySpec("chat_n2", "/v1/chat/completions", {**base, "n": 2, "messages": chats[1]}))
    return specs


def bad_requests(context: int, max_n: int) -> list[tuple[str, str, dict[str, Any] | bytes, int]]:
    """(name, path, body, the documented status). Checked once against the router before the soak: some are
    refused by smg's own validation (temperature, top_p, messages), the rest are forwarded and Ember refuses them."""
    m = MODEL_NAME
    return [
        ("temperature<0", "/v1/completions", {"model": m, "prompt": "x", "temperature": -1}, 400),
        ("max_tokens=0", "/v1/completions", {"model": m, "prompt": "x", "max_tokens": 0}, 400),
        ("top_p=0", "/v1/completions", {"model": m, "prompt": "x", "max_tokens": 2, "top_p": 0}, 400),
        ("n>max_n", "/v1/completions", {"model": m, "prompt": "x", "max_tokens": 2, "n": max_n + 1}, 400),
        ("over_context", "/v1/completions", {"model": m, "prompt": "x", "max_tokens": context + 1}, 400),
        ("over_context_stream", "/v1/chat/completions",
         {"model": m, "messages": [{"role": "user", "content": "x"}], "max_tokens": context + 1, "stream": True}, 400),
        ("empty_messages", "/v1/chat/completions", {"model": m, "messages": []}, 400),
        ("bad_role", "/v1/chat/completions", {"model": m, "messages": [{"role": "robot", "content": "x"}]}, 400),
        ("logit_bias_key", "/v1/completions", {"model": m, "prompt": "x", "logit_bias": {"abc": 1}}, 400),
        ("not_json", "/v1/completions", b"{not json", 400),
        ("unknown_model", "/v1/completions", {"model": "gpt-4", "prompt": "x", "max_tokens": 2}, 404),
    ]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(["alpha", "bravo", "charlie", "delta", "echo", "fox", "golf", "hotel"])
                    + str(rng.randrange(100)) for _ in range(n))


def long_text(rng: random.Random, chars: int) -> str:
    """Random 5-letter groups: fresh every time, so each long prompt is a real prefill, not a prefix-cache hit."""
    groups = (chars + 5) // 6
    return " ".join("".join(rng.choice(LONG_ALPHABET) for _ in range(5)) for _ in range(groups))[:chars]


# ---- one attempt ---------------------------------------------------------------------------------------------
@dataclass
class Attempt:
    kind: str
    outcome: str  # ok | aborted | bad_ok | doc503 | fault | invalid
    status: int | str  # HTTP status, or "transport" / "timeout"
    t0: float
    t1: float
    detail: str = ""
    texts: dict[int, str] = field(default_factory=dict)
    retry_after: float = 0.0
    rid: str = ""  # the response id, which Ember's per-request log line carries


@dataclass
class StreamRead:
    texts: dict[int, str]
    finishes: dict[int, str]
    chunks: int
    done: bool
    error: str | None
    rid: str = ""


def read_stream(resp: httpx.Response, stop_after: int | None = None) -> StreamRead:
    """Text and finish reason per choice index of an SSE stream (completions or chat); stops after `stop_after`
    content chunks when given (the caller then closes the connection: a client disconnect)."""
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, str] = {}
    chunks, done, error, rid = 0, False, None, ""
    for line in resp.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            break
        obj = json.loads(data)
        if "error" in obj:  # smg's event when the upstream replica died mid-stream
            error = json.dumps(obj)[:300]
            continue
        rid = rid or obj.get("id", "")
        for ch in obj.get("choices") or []:
            texts[ch["index"]] += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
            if ch.get("finish_reason"):
                finishes[ch["index"]] = ch["finish_reason"]
        chunks += 1
        if stop_after is not None and chunks >= stop_after:
            break
    return StreamRead(dict(texts), finishes, chunks, done, error, rid)


def body_texts(body: dict[str, Any]) -> tuple[dict[int, str], dict[int, str]]:
    texts, finishes = {}, {}
    for ch in body["choices"]:
        texts[ch["index"]] = ch["text"] if "text" in ch else (ch["message"].get("content") or "")
        finishes[ch["index"]] = ch["finish_reason"]
    return texts, finishes


def classify_error(resp: httpx.Response, kind: str, t0: float) -> Attempt:
    """An error status: a documented 503, a retryable fault (other 5xx), or invalid (a 4xx to a valid request)."""
    status = resp.status_code
    try:
        err = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        err = None
    text = resp.text[:300]
    if status == 503 and err and err.get("code") in DOCUMENTED_503:
        return Attempt(kind, "doc503", status, t0, time.monotonic(), text,
                       retry_after=float(resp.headers.get("Retry-After", "1")))
    return Attempt(kind, "fault" if status >= 500 else "invalid", status, t0, time.monotonic(), text)


def post(client: httpx.Client, kind: str, path: str, body: dict[str, Any], n: int, *, stream: bool,
         stop_after: int | None = None, read_timeout: float | None = None) -> Attempt:
    """One attempt, validated: `ok` means a whole, well-formed answer with n choices that all finished."""
    t0 = time.monotonic()
    timeout = httpx.Timeout(120.0, read=read_timeout) if read_timeout else httpx.USE_CLIENT_DEFAULT
    try:
        if not stream:
            resp = client.post(path, json=body, timeout=timeout)
            if resp.status_code != 200:
                return classify_error(resp, kind, t0)
            texts, finishes = body_texts(resp.json())
            done, error, rid = True, None, resp.json().get("id", "")
        else:
            with client.stream("POST", path, json={**body, "stream": True}, timeout=timeout) as resp:
                if resp.status_code != 200:
                    resp.read()
                    return classify_error(resp, kind, t0)
                got = read_stream(resp, stop_after)
            if stop_after is not None and not got.done and got.error is None:
                return Attempt(kind, "aborted", 200, t0, time.monotonic(), texts=got.texts, rid=got.rid)
            texts, finishes, done, error, rid = got.texts, got.finishes, got.done, got.error, got.rid
    except httpx.TimeoutException as exc:
        if read_timeout:  # the intended disconnect of a client that gave up
            return Attempt(kind, "aborted", "client_timeout", t0, time.monotonic())
        return Attempt(kind, "fault", "timeout", t0, time.monotonic(), repr(exc))
    except httpx.TransportError as exc:
        return Attempt(kind, "fault", "transport", t0, time.monotonic(), repr(exc))
    except (ValueError, KeyError, TypeError) as exc:
        return Attempt(kind, "invalid", 200, t0, time.monotonic(), f"malformed body: {exc!r}")
    t1 = time.monotonic()
    if error is not None or not done:
        return Attempt(kind, "fault", "stream_error" if error else "stream_cut", t0, t1, error or "no [DONE]",
                       texts=texts)
    if sorted(finishes) != list(range(n)) or any(f not in ("length", "stop") for f in finishes.values()):
        return Attempt(kind, "invalid", 200, t0, t1, f"choices/finish reasons {finishes} for n={n}")
    return Attempt(kind, "ok", 200, t0, t1, texts=texts, rid=rid)


def post_bad(client: httpx.Client, path: str, body: dict[str, Any] | bytes, expected: int) -> Attempt:
    t0 = time.monotonic()
    try:
        if isinstance(body, bytes):
            resp = client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            resp = client.post(path, json=body)
    except httpx.TransportError as exc:
        return Attempt("bad", "fault", "transport", t0, time.monotonic(), repr(exc))
    if resp.status_code == expected:
        try:
            err = resp.json()["error"]
            shaped = isinstance(err["message"], str) and isinstance(err["type"], str) and "Traceback" not in resp.text
        except (ValueError, KeyError, TypeError):
            shaped = False
        if shaped:
            return Attempt("bad", "bad_ok", expected, t0, time.monotonic())
        return Attempt("bad", "invalid", expected, t0, time.monotonic(), f"not OpenAI's error shape: {resp.text[:200]}")
    if resp.status_code >= 500:
        return classify_error(resp, "bad", t0)
    return Attempt("bad", "invalid", resp.status_code, t0, time.monotonic(),
                   f"{path} {str(body)[:80]}: expected {expected}: {resp.text[:200]}")


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def direct_client(replica: Replica) -> httpx.Client:
    return httpx.Client(base_url=replica.url, headers=auth(), timeout=120)
