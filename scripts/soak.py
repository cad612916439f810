"""Bounded soak of Ember replicas behind the smg router, under faults.

    .venv/bin/python scripts/soak.py                   # ~300 s, 3 replicas, 8 client threads
    .venv/bin/python scripts/soak.py --short --json s.json  # CI-sized: 45 s of load (~80 s in all), 6 clients

It starts N real `ember serve` replicas (the tiny random Llama unless --model is given; one compute thread each)
and smg in front of them (tests/support/router_harness.py), then client threads drive mixed traffic through the router
until --duration runs out:

- `sample`: /v1/completions or /v1/chat/completions, streamed or not, n = 1..3, temperature 0.8;
- `greedy`: a fixed set of prompts (completions and chat, one with n = 2) at temperature 0 with ignore_eos and a
  fixed max_tokens, streamed or not; each output is compared at the end with its solo run;
- `long`: a fresh random prompt just under the context (sized with the replica's own tokenizer), max_tokens 8;
- `disconnect`: a long stream closed by the client after 1-4 chunks, or a non-streamed long request whose client
  gives up after a 50-150 ms read timeout (both are "aborted": their outputs are not compared);
- `bad`: invalid requests that must get their documented 4xx (400, or 404 for an unknown model) in OpenAI's
  error shape, whether smg's own validation or Ember answers them.

Faults, at 30 % and 60 % of the duration: a busy replica is drained (SIGTERM; it must exit 0 without the
grace-period abort) and restarted on its port; later another busy replica is SIGKILLed and restarted.

How failures are counted. Every request is an "attempt"; a faulted attempt (a 5xx, a transport error or read
timeout, a stream that ends in an `{"error": ...}` event or without [DONE]) is retried once by its client, as
a real client would. Documented 503s (code "draining" or "service_unavailable", with Retry-After) are allowed at
any time; the client waits the Retry-After and retries once. Any other faulted attempt is *excused* only if it
overlaps a fault window (from the signal to the replica until smg reports it healthy again, plus 5 s: the
router-generated 502/503 and cut streams of a killed replica) **and** the client's retry succeeds. Everything else
is a violation: a 500 ever (smg retries worker 5xx itself, so the replica logs are also scanned for Ember's
"unhandled error" and for tracebacks), a faulted attempt outside a fault window, a retry that failed too, a valid
request refused with a 4xx, a bad request answered with anything but its documented error, a malformed body.

Checks at the end (after the clients stop and the replicas drain; exit 1 if any fails):
- no violations (above); no unhandled error or traceback in any replica log;
- every replica's `ember:kv_pool_used_slots`, `ember:num_requests_running` and `ember:num_requests_waiting` are 0
  (bounded poll, 60 s);
- RSS growth of every replica process (each life of a restarted replica separately, from after its warm-up to the
  end of that life) is below RSS_BOUND_MIB = 150 MiB or RSS_BOUND_FRAC = 25 % of its start, whichever is larger.
  Measured first (tiny model, 7 runs): a replica is at 330-380 MiB after its warm-up, rises 16-47 MiB in the
  first ~15 s of concurrent load (first use of the larger batch shapes), then stays flat within +-15 MiB for the
  rest of a 300 s soak (sampled every 5 s: `samples` in the JSON). The bound is ~3x the largest growth seen and
  still catches a leak above ~50 KiB per request (a replica serves ~3000 requests in the 300 s run);
- every non-aborted greedy output equals its solo run (computed against every replica directly before the load,
  which must agree with each other), and every aborted greedy stream's partial text is a prefix of it;
- every replica served requests during the soak (counted from its log, which survives restarts);
- the drained replica exited 0 without aborting its running requests.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "support"))

from router_harness import Cluster, Replica, start_cluster, stop_cluster  # noqa: E402
from server_harness import API_KEY, MODEL_NAME, idle, metrics, tiny_server_args  # noqa: E402

SOAK_CONTEXT = 4096  # the tiny model's context: long prompts near it prefill in ~0.5 s on one thread
RSS_BOUND_MIB = 150.0
RSS_BOUND_FRAC = 0.25
FAULT_GRACE_S = 5.0  # after smg reports the replica healthy again: requests routed just before still drain
GREEDY_MAX_TOKENS = 32
DOCUMENTED_503 = {"draining", "service_unavailable"}
KINDS = {"sample": 30, "greedy": 30, "long": 8, "disconnect": 12, "bad": 10}  # relative weights
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


T0 = time.monotonic()


def say(msg: str) -> None:
    """A progress line (stdout; the summary comes at the end)."""
    print(f"[{time.monotonic() - T0:6.1f} s] {msg}", flush=True)


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


# ---- the soak ------------------------------------------------------------------------------------------------
@dataclass
class Life:
    """One process of a replica: a restarted replica gets a new one."""
    pid: int
    rss_start_mib: float
    rss_end_mib: float = 0.0
    rss_peak_mib: float = 0.0
    ended: str = "running"  # running | drained | killed
    samples: list[float] = field(default_factory=list)  # RSS every ~5 s: a plateau or a slope

    @property
    def growth_mib(self) -> float:
        return self.rss_end_mib - self.rss_start_mib

    def bound_mib(self) -> float:
        return max(RSS_BOUND_MIB, RSS_BOUND_FRAC * self.rss_start_mib)


@dataclass
class Fault:
    kind: str  # drain | kill
    replica: int
    t_signal: float
    t_healthy: float = float("inf")
    detail: dict[str, Any] = field(default_factory=dict)

    def covers(self, t0: float, t1: float) -> bool:
        return t0 <= self.t_healthy + FAULT_GRACE_S and t1 >= self.t_signal


@dataclass
class Request:
    kind: str
    attempts: list[Attempt]
    greedy_key: str | None = None


class Soak:
    def __init__(self, cluster: Cluster, args: argparse.Namespace) -> None:
        self.cluster, self.args = cluster, args
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.requests: list[Request] = []
        self.faults: list[Fault] = []
        self.lives: dict[int, list[Life]] = {r.index: [] for r in cluster.replicas}
        info = httpx.get(cluster.replicas[0].url + "/get_server_info", headers=auth(), timeout=10).json()
        self.context, self.max_n = int(info["context_length"]), int(info["max_n"])
        self.long_chars = self.long_prompt_chars()
        self.specs = greedy_specs()
        self.bad = bad_requests(self.context, self.max_n)
        self.solo: dict[str, dict[int, str]] = {}
        self.long_prompt_tokens: list[int] = []
        self.log_offsets: dict[int, int] = {}
        self.crashes: list[str] = []
        self.warm_ids: set[str] = set()

    # -- before the load --
    def long_prompt_chars(self) -> int:
        """Characters of a long prompt that stays under the context with max_tokens 8, from the replica's own
        tokenizer: tokens per character of a sample, with a 3 % + 16-token margin."""
        sample = long_text(random.Random(0), 2000)
        r = httpx.post(self.cluster.replicas[0].url + "/v1/tokenize", headers=auth(), timeout=30,
                       json={"model": MODEL_NAME, "prompt": sample})
        r.raise_for_status()
        got = r.json()
        per_char = max(int(got.get("count") or len(got["tokens"])) / len(sample), 1e-3)
        return int((self.context - 8 - 16 - 0.03 * self.context) / per_char)

    def solo_runs(self) -> list[str]:
        """Each greedy spec alone on every replica (nothing else running); returns disagreements between replicas."""
        problems = []
        for spec in self.specs:
            outs = []
            for r in self.cluster.replicas:
                with direct_client(r) as c:
                    resp = c.post(spec.path, json=spec.body)
                    resp.raise_for_status()
                    outs.append(body_texts(resp.json())[0])
            self.solo[spec.key] = outs[0]
            if any(o != outs[0] for o in outs):
                problems.append(f"{spec.key}: solo outputs differ between replicas: {outs}")
        return problems

    def warm_up(self, replica: Replica) -> None:
        """One request of each shape directly on a replica, so the RSS baseline is taken after the first-use
        allocations (long prefill, n = 3, streaming, an abort), not before them."""
        rng = random.Random(replica.index)
        with direct_client(replica) as c:
            done = [
                post(c, "warm", "/v1/completions", {"model": MODEL_NAME, "max_tokens": 8, "ignore_eos": True,
                                                    "prompt": long_text(rng, self.long_chars)}, 1, stream=False),
                post(c, "warm", "/v1/completions", {"model": MODEL_NAME, "max_tokens": 16, "n": 3,
                                                    "temperature": 0.8, "prompt": words(rng, 20)}, 3, stream=True),
                post(c, "warm", "/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 16, "messages": [
                    {"role": "user", "content": words(rng, 10)}]}, 1, stream=True),
                post(c, "warm", "/v1/completions", {"model": MODEL_NAME, "max_tokens": 256, "ignore_eos": True,
                                                    "prompt": words(rng, 10)}, 1, stream=True, stop_after=2)]
        if any(a.outcome not in ("ok", "aborted") for a in done):
            raise RuntimeError(f"warm-up of replica {replica.index} failed: {[a.detail for a in done]}")
        self.warm_ids |= {a.rid for a in done}  # a restarted replica's warm-up is not soak traffic it served
        wait_idle(replica, 30)

    def begin_life(self, replica: Replica) -> None:
        rss = round(rss_mib(replica), 1)
        self.lives[replica.index].append(Life(replica.server.proc.pid, rss, rss, rss))

    def sample_rss(self, replica: Replica, ended: str | None = None) -> None:
        life = self.lives[replica.index][-1]
        if replica.server.proc.poll() is None:
            life.rss_end_mib = round(rss_mib(replica), 1)
            life.rss_peak_mib = max(life.rss_peak_mib, life.rss_end_mib)
            life.samples.append(life.rss_end_mib)
        if ended:
            life.ended = ended

    # -- clients --
    def client_loop(self, k: int) -> None:
        rng = random.Random(self.args.seed * 1000 + k)
        kinds, weights = zip(*KINDS.items())
        try:
            with self.cluster.client(timeout=120) as c:
                while not self.stop.is_set():
                    kind = rng.choices(kinds, weights)[0]
                    req = getattr(self, f"do_{kind}")(c, rng)
                    with self.lock:
                        self.requests.append(req)
        except Exception as exc:  # a bug of this script, not of the server: still a failed soak
            with self.lock:
                self.crashes.append(f"client {k}: {exc!r}")
            raise

    def with_retry(self, once: Callable[[], Attempt]) -> list[Attempt]:
        """An attempt and, if it faulted or got a documented 503, one retry (after the Retry-After)."""
        first = once()
        if first.outcome not in ("fault", "doc503"):
            return [first]
        if first.retry_after:
            self.stop.wait(first.retry_after)  # honouring Retry-After, as a client should; stop cuts it short
        return [first, once()]

    def do_sample(self, c: httpx.Client, rng: random.Random) -> Request:
        n = rng.choice([1, 1, 2, 3])
        common = {"model": MODEL_NAME, "n": n, "temperature": 0.8, "top_p": 0.95, "max_tokens": rng.randint(4, 48)}
        if rng.random() < 0.5:
            path, body = "/v1/completions", {**common, "prompt": words(rng, rng.randint(3, 80))}
        else:
            path, body = "/v1/chat/completions", {**common, "messages": [{"role": "user",
                                                                           "content": words(rng, rng.randint(3, 60))}]}
        stream = rng.random() < 0.5
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return Request("sample", self.with_retry(lambda: post(c, "sample", path, body, n, stream=stream)))

    def do_greedy(self, c: httpx.Client, rng: random.Random) -> Request:
        spec = rng.choice(self.specs)
        n, stream = int(spec.body.get("n", 1)), rng.random() < 0.5
        return Request("greedy", self.with_retry(lambda: post(c, "greedy", spec.path, spec.body, n,
                                                                        stream=stream)), spec.key)

    def do_long(self, c: httpx.Client, rng: random.Random) -> Request:
        body = {"model": MODEL_NAME, "prompt": long_text(rng, self.long_chars), "max_tokens": 8, "ignore_eos": True,
                "temperature": 0}
        stream = rng.random() < 0.5
        return Request("long", self.with_retry(lambda: post(c, "long", "/v1/completions", body, 1,
                                                                    stream=stream)))

    def do_disconnect(self, c: httpx.Client, rng: random.Random) -> Request:
        """A client that goes away: its request must be aborted (or finish) and its KV freed either way. Some are
        greedy specs run longer, whose partial text must still be a prefix of the solo output."""
        if rng.random() < 0.3:
            spec = rng.choice([s for s in self.specs if "n" not in s.body])
            k = rng.randint(1, 4)
            return Request("disconnect", self.with_retry(lambda: post(
                c, "disconnect", spec.path, spec.body, 1, stream=True, stop_after=k)), spec.key)
        body = {"model": MODEL_NAME, "prompt": words(rng, 20), "max_tokens": 384, "ignore_eos": True,
                "temperature": 0.8}
        if rng.random() < 0.6:
            once = partial(post, c, "disconnect", "/v1/completions", body, 1, stream=True, stop_after=rng.randint(1, 4))
        else:
            once = partial(post, c, "disconnect", "/v1/completions", body, 1, stream=False,
                           read_timeout=rng.uniform(0.05, 0.15))
        return Request("disconnect", self.with_retry(once))

    def do_bad(self, c: httpx.Client, rng: random.Random) -> Request:
        _, path, body, expected = rng.choice(self.bad)
        return Request("bad", self.with_retry(lambda: post_bad(c, path, body, expected)))

    # -- faults --
    def busy_replica(self, exclude: set[int], timeout: float = 15.0) -> tuple[Replica, float]:
        """A live replica running requests now (bounded poll of /metrics), so the fault hits work in flight;
        the first candidate if none gets busy in time."""
        candidates = [r for r in self.cluster.replicas if r.index not in exclude] or self.cluster.replicas
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for r in candidates:
                try:
                    if (running := metrics(r.server)["ember:num_requests_running"]) > 0:
                        return r, running
                except httpx.HTTPError:
                    pass
            time.sleep(0.05)  # poll interval of a bounded wait on other processes
        return candidates[0], 0.0

    def fault(self, kind: str, exclude: set[int]) -> Fault:
        victim, running = self.busy_replica(exclude)
        log_start = victim.log_path.stat().st_size
        self.sample_rss(victim)
        fault = Fault(kind, victim.index, time.monotonic(), detail={"running_at_signal": running})
        with self.lock:
            self.faults.append(fault)
        say(f"{kind}: replica {victim.index} (pid {victim.server.proc.pid}, {running:.0f} running)")
        victim.server.proc.send_signal(signal.SIGTERM if kind == "drain" else signal.SIGKILL)
        code = victim.server.proc.wait(60)  # an event: the process exits
        fault.detail["exit_code"] = code
        self.sample_rss(victim, ended="drained" if kind == "drain" else "killed")
        if kind == "drain":
            log = victim.log_path.read_text(errors="replace")[log_start:]
            drained = [int(x) for x in re.findall(r"draining: (\d+) requests in flight", log)]
            fault.detail["in_flight_at_drain"] = drained[-1] if drained else None
            fault.detail["grace_abort"] = "grace period over" in log
            fault.detail["clean"] = code == 0 and "drained; shutting down" in log and "grace period over" not in log
        fault.detail["unhealthy_after_s"] = round(self.cluster.wait_worker(victim.url, healthy=False), 2)
        victim.restart()
        self.warm_up(victim)
        self.begin_life(victim)
        fault.detail["healthy_after_s"] = round(self.cluster.wait_worker(victim.url, healthy=True, timeout=60), 2)
        fault.t_healthy = time.monotonic()
        fault.detail["down_s"] = round(fault.t_healthy - fault.t_signal, 2)
        say(f"replica {victim.index} back (pid {victim.server.proc.pid}) after {fault.detail['down_s']} s")
        return fault

    # -- the whole run --
    def run(self) -> None:
        threads = [threading.Thread(target=self.client_loop, args=(k,), daemon=True) for k in range(self.args.clients)]
        t_start = time.monotonic()
        schedule = [(0.3, "drain"), (0.6, "kill")]
        for t in threads:
            t.start()
        hit: set[int] = set()
        for frac, kind in schedule:
            self.idle_until(t_start + frac * self.args.duration)
            hit.add(self.fault(kind, exclude=hit).replica)
        self.idle_until(t_start + self.args.duration)
        self.stop.set()
        say(f"load stopped after {len(self.requests)} requests; waiting for the clients' last ones")
        for t in threads:
            t.join(180)  # each client finishes its current request (bounded by its timeouts)
        self.elapsed = time.monotonic() - t_start

    def idle_until(self, t: float) -> None:
        """Wait for the next scheduled moment, sampling every replica's RSS every 5 s meanwhile."""
        while (left := t - time.monotonic()) > 0:
            self.stop.wait(min(5.0, left))  # a clock, not a synchronisation: the schedule is by wall time
            for r in self.cluster.replicas:
                self.sample_rss(r)


# ---- helpers on replicas -------------------------------------------------------------------------------------
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def direct_client(replica: Replica) -> httpx.Client:
    return httpx.Client(base_url=replica.url, headers=auth(), timeout=120)


def rss_mib(replica: Replica) -> float:
    """Resident memory of the replica process and any children (the engine runs in-process, threads only)."""
    proc = psutil.Process(replica.server.proc.pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20


def wait_idle(replica: Replica, timeout: float) -> dict[str, float]:
    """Bounded poll of the replica's /metrics until no request holds KV, runs or waits; the last metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(replica.server)
        if idle(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)  # poll interval of a bounded wait on another process


FINISHED_RE = re.compile(r"request (\S+) finished: .* finish_reason=(\w+)")


def finished_in_log(replica: Replica, offset: int, skip: set[str]) -> Counter[str]:
    """Finish reasons of the requests logged since `offset` but those in `skip`: the log is appended across
    restarts, unlike /metrics, so it counts every life of the replica."""
    text = replica.log_path.read_text(errors="replace")[offset:]
    return Counter(reason for rid, reason in FINISHED_RE.findall(text) if rid not in skip)


def log_errors(replica: Replica, offset: int) -> list[str]:
    text = replica.log_path.read_text(errors="replace")[offset:]
    return [line[:300] for line in text.splitlines() if "unhandled error" in line or "Traceback" in line
            or " ERROR " in line]


# ---- verdict -------------------------------------------------------------------------------------------------
def judge(soak: Soak, end_metrics: dict[int, dict[str, float]], problems_solo: list[str]) -> dict[str, Any]:
    reqs = soak.requests
    attempts = [a for r in reqs for a in r.attempts]
    violations: list[str] = list(soak.crashes)
    excused = doc503 = 0
    for r in reqs:
        for i, a in enumerate(r.attempts):
            last = i == len(r.attempts) - 1
            if a.status == 500:
                violations.append(f"{r.kind}: 500: {a.detail}")
            elif a.outcome == "invalid":
                violations.append(f"{r.kind}: invalid answer ({a.status}): {a.detail}")
            elif a.outcome == "doc503":
                doc503 += 1
            elif a.outcome == "fault":
                # a documented 503 is an allowed answer to the retry as to any request
                retried_ok = not last and r.attempts[-1].outcome in ("ok", "bad_ok", "aborted", "doc503")
                in_window = any(f.covers(a.t0, a.t1) for f in soak.faults)
                if retried_ok and in_window:
                    excused += 1
                else:
                    why = "its retry failed too" if not retried_ok else "outside any fault window"
                    violations.append(f"{r.kind}: {a.status} ({why}): {a.detail[:200]}")

    greedy_cmp = greedy_bad = partial_cmp = 0
    greedy_problems: list[str] = []
    for r in reqs:
        if r.greedy_key is None:
            continue
        solo = soak.solo[r.greedy_key]
        for a in r.attempts:
            if a.outcome == "ok":
                greedy_cmp += 1
                if a.texts != solo:
                    greedy_bad += 1
                    greedy_problems.append(f"{r.greedy_key}: {a.texts!r} != solo {solo!r}")
            elif a.texts:  # cut by the client or by a killed replica: what arrived is a prefix
                partial_cmp += 1
                if any(not solo.get(i, "").startswith(t) for i, t in a.texts.items()):
                    greedy_bad += 1
                    greedy_problems.append(f"{r.greedy_key} (partial): {a.texts!r} not a prefix of {solo!r}")

    not_idle = {i: {k: v for k, v in m.items() if k in KV_KEYS} for i, m in end_metrics.items() if not idle(m)}
    rss_bad = [f"replica {i} pid {life.pid}: +{life.growth_mib:.1f} MiB > {life.bound_mib():.0f}"
               for i, lives in soak.lives.items() for life in lives if life.growth_mib > life.bound_mib()]
    finished = {r.index: finished_in_log(r, soak.log_offsets[r.index], soak.warm_ids) for r in soak.cluster.replicas}
    served = {i: sum(f.values()) for i, f in finished.items()}
    errors = {r.index: log_errors(r, soak.log_offsets[r.index]) for r in soak.cluster.replicas}
    drains = [f for f in soak.faults if f.kind == "drain"]
    checks = {
        "no_5xx_beyond_documented": (not violations, violations[:20]),
        "no_errors_in_replica_logs": (not any(errors.values()), {i: e[:5] for i, e in errors.items() if e}),
        "kv_pool_and_queues_idle": (not not_idle, not_idle),
        "rss_growth_bounded": (not rss_bad, rss_bad),
        "greedy_equals_solo": (greedy_bad == 0 and not problems_solo and greedy_cmp > 0,
                               (problems_solo + greedy_problems)[:10]),
        "every_replica_served": (all(v > 0 for v in served.values()), served),
        "drain_clean": (all(f.detail.get("clean") for f in drains), [f.detail for f in drains]),
    }
    by_kind: dict[str, Counter[str]] = defaultdict(Counter)
    for r in reqs:
        by_kind[r.kind][r.attempts[-1].outcome] += 1
    aborts_engine = sum(f["abort"] for f in finished.values())
    return {
        "passed": all(ok for ok, _ in checks.values()),
        "checks": {k: {"passed": ok, "detail": d} for k, (ok, d) in checks.items()},
        "config": {"duration_s": soak.args.duration, "elapsed_s": round(soak.elapsed, 1),
                   "replicas": len(soak.cluster.replicas), "clients": soak.args.clients, "seed": soak.args.seed,
                   "context": soak.context, "long_prompt_chars": soak.long_chars,
                   "rss_bound": f"max({RSS_BOUND_MIB:.0f} MiB, {RSS_BOUND_FRAC:.0%} of start)"},
        "requests": len(reqs),
        "attempts": len(attempts),
        "requests_per_s": round(len(reqs) / soak.elapsed, 1),
        "status_counts": dict(Counter(str(a.status) for a in attempts)),
        "outcome_counts": dict(Counter(a.outcome for a in attempts)),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "retries": sum(len(r.attempts) - 1 for r in reqs),
        "retries_succeeded": sum(1 for r in reqs if len(r.attempts) > 1
                                 and r.attempts[-1].outcome in ("ok", "bad_ok", "aborted")),
        "faults_excused": excused,
        "documented_503": doc503,
        "violations": len(violations),
        "client_aborts": sum(1 for a in attempts if a.outcome == "aborted"),
        "engine_aborts": aborts_engine,
        "finish_reasons": dict(sum(finished.values(), Counter())),
        "greedy": {"comparisons": greedy_cmp, "partial_prefix_checks": partial_cmp, "mismatches": greedy_bad,
                   "specs": len(soak.specs)},
        "served_per_replica": served,
        "replicas": {i: [asdict(life) | {"growth_mib": round(life.growth_mib, 1)} for life in lives]
                     for i, lives in soak.lives.items()},
        "faults": [{"kind": f.kind, "replica": f.replica, **f.detail} for f in soak.faults],
        "restarts": len(soak.faults),
        "end_metrics": {i: {k: v for k, v in m.items() if k in KV_KEYS} for i, m in end_metrics.items()},
    }


KV_KEYS = ("ember:kv_pool_used_slots", "ember:num_requests_running", "ember:num_requests_waiting")


def print_summary(s: dict[str, Any]) -> None:
    c = s["config"]
    print(f"\n=== soak: {c['replicas']} replicas, {c['clients']} clients, {c['elapsed_s']} s "
          f"(context {c['context']}, long prompts {c['long_prompt_chars']} chars) ===")
    print(f"requests {s['requests']} ({s['requests_per_s']}/s), attempts {s['attempts']}, retries {s['retries']} "
          f"({s['retries_succeeded']} succeeded), excused faults {s['faults_excused']}, documented 503s "
          f"{s['documented_503']}, violations {s['violations']}")
    print("status counts: " + ", ".join(f"{k}: {v}" for k, v in sorted(s["status_counts"].items())))
    print("outcomes:      " + ", ".join(f"{k}: {v}" for k, v in sorted(s["outcome_counts"].items())))
    for kind, out in s["by_kind"].items():
        print(f"  {kind:<11} " + ", ".join(f"{k}: {v}" for k, v in sorted(out.items())))
    print(f"client disconnects {s['client_aborts']}, engine aborts {s['engine_aborts']}, "
          f"finish reasons {s['finish_reasons']}")
    g = s["greedy"]
    print(f"greedy: {g['comparisons']} whole outputs and {g['partial_prefix_checks']} partial ones compared with "
          f"their solo runs ({g['specs']} specs), {g['mismatches']} mismatches")
    for f in s["faults"]:
        print(f"fault: {f['kind']} replica {f['replica']}: " + ", ".join(f"{k}={v}" for k, v in f.items()
                                                                            if k not in ("kind", "replica")))
    print(f"{'replica':<8} {'pid':>8} {'ended':>8} {'RSS start':>10} {'end':>8} {'peak':>8} {'growth':>8} "
          f"{'served':>7}  (MiB; served over all lives)")
    for i, lives in s["replicas"].items():
        for j, life in enumerate(lives):
            print(f"{i if j == 0 else '':<8} {life['pid']:>8} {life['ended']:>8} {life['rss_start_mib']:>10.1f} "
                  f"{life['rss_end_mib']:>8.1f} {life['rss_peak_mib']:>8.1f} {life['growth_mib']:>+8.1f} "
                  f"{s['served_per_replica'][i] if j == 0 else '':>7}")
    print("checks:")
    for name, chk in s["checks"].items():
        print(f"  [{'PASS' if chk['passed'] else 'FAIL'}] {name}" + ("" if chk["passed"] else f": {chk['detail']}"))
    print("SOAK PASSED" if s["passed"] else "SOAK FAILED")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=None, help="seconds of load (default 300; 45 with --short)")
    p.add_argument("--short", action="store_true", help="CI-sized: 45 s, 3 replicas, 6 clients unless given")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--clients", type=int, default=None, help="client threads (default 8; 6 with --short)")
    p.add_argument("--model", type=Path, default=None, help="model folder (default: the tiny random Llama)")
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    p.add_argument("--log-dir", type=Path, default=None, help="replica and router logs (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.duration = args.duration or (45.0 if args.short else 300.0)
    args.clients = args.clients or (6 if args.short else 8)
    if args.replicas < 2:
        p.error("--replicas must be at least 2 (a fault takes one down)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ember-soak-") as tmp:
        model = args.model
        if model is None:
            from tiny_models import write_tiny_model
            model = write_tiny_model(Path(tmp) / "model", "llama", max_position_embeddings=SOAK_CONTEXT)
        log_dir = args.log_dir or Path(tmp) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        # a queue deep enough that the clients never fill it: a full queue is a documented 503, but not the point
        server_args = [*tiny_server_args(model), "--max-queued-requests", "64"]
        say(f"starting {args.replicas} replicas and smg (logs in {log_dir})")
        cluster = start_cluster(args.replicas, lambda i: server_args, log_dir)
        try:
            soak = Soak(cluster, args)
            problems_solo = soak.solo_runs()
            for r in cluster.replicas:
                soak.warm_up(r)
                soak.begin_life(r)
                soak.log_offsets[r.index] = r.log_path.stat().st_size
            say(f"solo runs and warm-up done; {args.clients} clients for {args.duration:.0f} s")
            soak.run()
            end_metrics = {r.index: wait_idle(r, 60) for r in cluster.replicas}
            say("clients done, replicas idle")
            for r in cluster.replicas:
                soak.sample_rss(r)
            summary = judge(soak, end_metrics, problems_solo)
            summary["log_dir"] = str(log_dir) if args.log_dir else None
        finally:
            stop_cluster(cluster)
    print_summary(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2, default=str))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
