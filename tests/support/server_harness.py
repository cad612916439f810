"""Harness of the server tests: a real `ember serve` in a subprocess on a free port, and helpers to read its
/metrics, its SSE streams and its errors.

The tiny model (conftest's `make_tiny_model`) has a real byte-level BPE tokenizer with a ChatML template and
random weights: its text is gibberish, but every token id, length, stop and logprob path is the real one.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
MODEL_NAME = "tiny-llama"  # served under this name (--served-model-name), whatever its folder is called
MAX_RUNNING, MAX_QUEUED, MAX_N, MAX_BYTES = 4, 2, 4, 65536
LONG = {"ignore_eos": True}  # extra_body: random weights may emit EOS at any step; these tests need lengths
TINY_CONTEXT = 16384  # long enough for requests that cannot finish during a test


def tiny_server_args(model_dir: Path) -> list[str]:
    """Eager float32, API key on, and small limits so every error class is reachable."""
    return ["--model", str(model_dir), "--served-model-name", MODEL_NAME, "--dtype", "float32", "--disable-compile",
            "--max-total-tokens", str(2 * TINY_CONTEXT), "--max-running-requests", str(MAX_RUNNING),
            "--max-queued-requests", str(MAX_QUEUED), "--max-n", str(MAX_N), "--max-request-bytes", str(MAX_BYTES),
            "--api-key", API_KEY]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def wait_for_health(server: Server, status: int = 200, timeout: float = 180.0) -> None:
    """Poll /health until it answers `status` (bounded; fails early if the process dies)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if httpx.get(server.base_url + "/health", timeout=1.0).status_code == status:
                return
        except httpx.TransportError:
            pass  # not listening yet
        # Bounded readiness poll of a separate process: there is no event to wait on across processes.
        time.sleep(0.1)
    raise TimeoutError(f"/health not {status} after {timeout} s:\n{server.log()[-4000:]}")


def start_server(args: list[str], log_path: Path, port: int | None = None) -> Server:
    """`python -m server.cli serve ARGS --port PORT` (a free one by default) in a subprocess (returns at once). One
    compute thread unless ARGS say otherwise: the engine would otherwise take every core of a shared test machine."""
    port = port or free_port()
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}  # only our flags count
    env = {**inherited, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--num-threads", "1", *args]
    with open(log_path, "ab") as log:  # appended: a restarted replica keeps its first life's log
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    return Server(proc, f"http://127.0.0.1:{port}", log_path)


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


@contextmanager
def run_server(args: list[str], log_path: Path, timeout: float = 180.0) -> Iterator[Server]:
    """A server that is ready (/health 200) for the duration of the block; SIGTERM after it."""
    server = start_server(args, log_path)
    try:
        wait_for_health(server, 200, timeout)
        yield server
    finally:
        stop_server(server)


# ---- clients and readers ----------------------------------------------------------------------------------
def openai_client(server: Server, api_key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=api_key, max_retries=0, timeout=60)


def http_client(server: Server) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def greedy(client: openai.OpenAI, prompt: str | list[int], max_tokens: int = 24, **extra: Any) -> Any:
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={**LONG, **extra})


def metrics(server: Server) -> dict[str, float]:
    """`name{labels}` -> value of every sample on /metrics."""
    out = {}
    for line in httpx.get(server.base_url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def wait_until(server: Server, cond: Callable[[dict[str, float]], bool], what: str,
               timeout: float = 20.0) -> dict[str, float]:
    """Poll /metrics until `cond` holds (bounded); returns the metrics that satisfied it."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if cond(m):
            return m
        if time.monotonic() > deadline:
            shown = {k: v for k, v in m.items() if "num_" in k or "kv_pool" in k}
            raise AssertionError(f"timed out waiting for {what}; last metrics: {shown}")
        time.sleep(0.02)  # poll interval of a bounded wait on another process, not a synchronisation


def idle(m: dict[str, float]) -> bool:
    return (m["ember:kv_pool_used_slots"] == 0 and m["ember:num_requests_running"] == 0
            and m["ember:num_requests_waiting"] == 0)


def sse_events(lines: Iterator[str]) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def read_completion_stream(resp: httpx.Response) -> tuple[str, str | None, list[str]]:
    """(text, last finish_reason, raw events) of a streamed /v1/completions response."""
    events = sse_events(resp.iter_lines())
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    return text, reasons[-1] if reasons else None, events


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """The response is an error of `status` in OpenAI's shape, without a traceback; returns its "error"."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in resp.text
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


@contextmanager
def tiny_server(model_dir: Path, log_path: Path, *extra: str) -> Iterator[Server]:
    """The eager tiny-model server most tests share (one per test module)."""
    with run_server([*tiny_server_args(model_dir), *extra], log_path) as server:
        yield server
