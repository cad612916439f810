#!/usr/bin/env python3
"""Time an `ember serve` start: seconds from launch to /health 200, and to the first streamed token.

    scripts/startup_time.py [--port 18123] [--all-buckets] -- [ember serve flags...]

Starts `ember serve` (the one next to this Python) with the given flags, polls /health, then streams one chat
completion and stops the server with SIGTERM. Prints one JSON line; the server's log goes to stderr. Run it
twice with the same --compile-cache-dir to compare a cold cache with a warm one. --all-buckets: before stopping,
also wait until /get_server_info lists every decode bucket as compiled (loaded or compiled in the background).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

POLL_S = 0.2


def _health(base: str) -> int:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0  # not listening yet


def _all_buckets_s(base: str, t0: float, deadline: float) -> float:
    """Seconds from launch until every configured decode bucket is ready (-1 on timeout)."""
    while time.perf_counter() - t0 < deadline:
        with urllib.request.urlopen(f"{base}/get_server_info", timeout=10) as r:
            info = json.load(r)
        if not info["compiled"] or set(info["decode_buckets"]) <= set(info["compiled_buckets"]):
            return time.perf_counter() - t0
        time.sleep(POLL_S)  # the buckets load in the server's background: polling its API is all there is
    return -1.0


def _first_token_s(base: str, t0: float) -> tuple[float, str]:
    body = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 16, "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", body, {"content-type": "application/json"})
    first, text = 0.0, ""
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if delta and not first:
                first = time.perf_counter() - t0
            text += delta
    return first, text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=18123)
    p.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
    p.add_argument("--all-buckets", action="store_true", help="also time until every decode bucket is ready")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="flags for ember serve (after --)")
    a = p.parse_args()
    flags = [x for x in a.serve_args if x != "--"]
    ember = Path(sys.executable).with_name("ember")
    base = f"http://127.0.0.1:{a.port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(ember), "serve", "--port", str(a.port), *flags], env=os.environ.copy())
    try:
        while _health(base) != 200:
            if proc.poll() is not None:
                print(f"ember serve exited with {proc.returncode} before /health was 200", file=sys.stderr)
                return 1
            if time.perf_counter() - t0 > a.timeout:
                print("timed out waiting for /health", file=sys.stderr)
                return 1
            time.sleep(POLL_S)  # polling an external process: there is nothing to wait on but its socket
        healthy = time.perf_counter() - t0
        first, text = _first_token_s(base, t0)
        buckets = _all_buckets_s(base, t0, a.timeout) if a.all_buckets else None
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    out = {"health_200_s": round(healthy, 1), "first_token_s": round(first, 1), "text": text, "exit_code": code}
    if buckets is not None:
        out["all_buckets_s"] = round(buckets, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
