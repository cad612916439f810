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
from collections.abc import Callable
from functools import partial
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "support"))

from router_harness import Cluster, Replica, start_cluster, stop_cluster  # noqa: E402
from server_harness import MODEL_NAME, idle, metrics, tiny_server_args  # noqa: E402
from soak_http import (Attempt, auth, bad_requests, body_texts, direct_client, greedy_specs, long_text,  # noqa: E402
                       post, post_bad, words)
from soak_verdict import Fault, Life, Request, judge, print_summary  # noqa: E402

SOAK_CONTEXT = 4096  # the tiny model's context: long prompts near it prefill in ~0.5 s on one thread
KINDS = {"sample": 30, "greedy": 30, "long": 8, "disconnect": 12, "bad": 10}  # relative weights


T0 = time.monotonic()


def say(msg: str) -> None:
    """A progress line (stdout; the summary comes at the end)."""
    print(f"[{time.monotonic() - T0:6.1f} s] {msg}", flush=True)


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
