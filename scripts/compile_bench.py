#!/usr/bin/env python3
"""Streaming tokens/s of one client while a server's decode buckets compile, against an eager server's rate.

    scripts/compile_bench.py [--port 18124] [--tokens 128] -- [ember serve flags...]

1. `ember serve --disable-compile FLAGS`: the eager rate (three streams, after one warm-up).
2. `ember serve FLAGS --compile-cache-dir <fresh temporary folder>`: the buckets compile in the background (the
   compile child, or the server's own thread where that is what the code does); one client streams --streams times
   back to back while buckets are still missing (/get_server_info), the server then idles until every bucket is in,
   and three more streams run on the compiled buckets.
Prints one JSON line: each phase's tok/s (median and all), the compile's wall time, peak RSS of the server and of
its compile child (sampled every 0.2 s). Numbers are noisy on a shared machine: run it on an idle one, twice.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil


def _get(base: str, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(base + path, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except OSError:
        return 0, b""


def _stream_tps(base: str, tokens: int) -> float:
    """Decode tokens/s of one streamed completion: tokens after the first over the time after the first."""
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"content-type": "application/json"})
    first = last = 0.0
    n = 0
    with urllib.request.urlopen(req, timeout=1200) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            elif chunk["choices"]:
                last = time.perf_counter()
                first = first or last
    return (n - 1) / (last - first) if last > first else 0.0


class _Server:
    def __init__(self, flags: list[str], port: int) -> None:
        ember = Path(sys.executable).with_name("ember")
        self.base = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([str(ember), "serve", "--port", str(port), *flags], env=os.environ.copy())
        self.peak = {"server": 0, "child": 0}
        self._done = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        me = psutil.Process(self.proc.pid)
        while not self._done.wait(0.2):
            try:
                self.peak["server"] = max(self.peak["server"], me.memory_info().rss)
                for kid in me.children(recursive=True):
                    if "engine.compile_worker" in " ".join(kid.cmdline()):
                        self.peak["child"] = max(self.peak["child"], kid.memory_info().rss)
            except psutil.Error:
                pass

    def wait_healthy(self, timeout: float = 1800) -> None:
        deadline = time.monotonic() + timeout
        while _get(self.base, "/health")[0] != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"ember serve never became healthy (exit {self.proc.poll()})")
            time.sleep(0.2)  # polling another process's socket

    def info(self) -> dict:
        return json.loads(_get(self.base, "/get_server_info")[1] or b"{}")

    def stop(self) -> None:
        self._done.set()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)


def _summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 1) if values else None, "all": [round(v, 1) for v in values]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=18124)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--streams", type=int, default=5, help="streams timed while the buckets compile")
    p.add_argument("--cache", default=None, help="an empty folder to compile into, kept afterwards (default: a "
                                                 "temporary one)")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="flags for ember serve (after --)")
    a = p.parse_args()
    flags = [x for x in a.serve_args if x != "--"]
    out: dict = {}

    eager = _Server([*flags, "--disable-compile"], a.port)
    try:
        eager.wait_healthy()
        _stream_tps(eager.base, 16)  # warm-up
        out["eager_tps"] = _summary([_stream_tps(eager.base, a.tokens) for _ in range(3)])
    finally:
        eager.stop()

    with tempfile.TemporaryDirectory(prefix="ember-compile-bench-") as tmp:
        cache = a.cache or tmp
        if any(Path(cache).glob("*")):
            raise SystemExit(f"{cache} is not empty: the compile would not be cold")
        t0 = time.perf_counter()
        server = _Server([*flags, "--compile-cache-dir", cache], a.port)
        try:
            server.wait_healthy()
            out["health_200_s"] = round(time.perf_counter() - t0, 1)
            buckets = server.info()["decode_buckets"]
            during: list[float] = []
            for _ in range(a.streams):  # the streams that ended with buckets still compiling count
                tps = _stream_tps(server.base, a.tokens)
                ready = server.info()["compiled_buckets"]
                if ready == buckets:
                    break
                during.append(tps)
                out["ready_after_streams"] = ready
            out["during_compile_tps"] = _summary(during)
            while server.info()["compiled_buckets"] != buckets:  # then idle: the compile gets the cores
                time.sleep(0.5)  # polling another process's progress
            out["compile_wall_s"] = round(time.perf_counter() - t0, 1)
            out["compiled_tps"] = _summary([_stream_tps(server.base, a.tokens) for _ in range(3)])
            out["compile_seconds"] = server.info()["compile_seconds"]
        finally:
            server.stop()
        out["peak_rss_mib"] = {k: round(v / 2**20) for k, v in server.peak.items()}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
