"""A real `ember serve` compiling its decode buckets in a child process (engine/compile_child.py): requests are served
while the child compiles, every bucket is loaded from what the child saved, and the child never outlives the server."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from conftest import MakeTinyModel
from server_harness import (MODEL_NAME, Server, greedy, metrics, openai_client, run_server, start_server,
                            stop_server, wait_for_health)

BUCKETS = [1, 2, 4]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tiny_model(make_tiny_model: MakeTinyModel) -> Path:
    return make_tiny_model("llama")


def _args(model: Path, cache: Path, *extra: str) -> list[str]:
    # Speculation off: the tests count decode steps per bucket, one per token (drafts would merge steps).
    return ["--model", str(model), "--served-model-name", MODEL_NAME, "--dtype", "float32", "--max-total-tokens",
            "4096", "--max-running-requests", "4", "--decode-buckets", "1,2,4", "--compile-cache-dir", str(cache),
            "--speculative", "off", *extra]


def _compile_children(server: Server) -> list[psutil.Process]:
    try:
        kids = psutil.Process(server.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for kid in kids:
        try:
            if "engine.compile_worker" in kid.cmdline():
                out.append(kid)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return out


def _info(server: Server) -> dict:
    return httpx.get(server.base_url + "/get_server_info", timeout=10).json()


def _wait_for_child(server: Server, timeout: float = 60.0) -> psutil.Process:
    """The compile child, once the server has started it (bounded poll of another process's children)."""
    deadline = time.monotonic() + timeout
    while not (kids := _compile_children(server)):
        assert _info(server)["compiled_buckets"] != BUCKETS, "every bucket was ready before a child was seen"
        assert time.monotonic() < deadline, f"no compile child after {timeout} s:\n{server.log()[-3000:]}"
        time.sleep(0.05)  # polling another process: nothing to wait on across the boundary
    assert len(kids) == 1
    return kids[0]


def _gone(proc: psutil.Process, timeout: float = 10.0) -> bool:
    try:
        proc.wait(timeout)  # our grandchild: returns once it is reaped (by the server) or gone
    except psutil.TimeoutExpired:
        return False
    return True


def test_requests_are_served_while_the_child_compiles_and_every_bucket_loads(tiny_model: Path,
                                                                             tmp_path: Path) -> None:
    eager_args = ["--model", str(tiny_model), "--served-model-name", MODEL_NAME, "--dtype", "float32",
                  "--disable-compile", "--max-total-tokens", "4096", "--max-running-requests", "4"]
    with run_server(eager_args, tmp_path / "eager.log") as eager:
        want = greedy(openai_client(eager), PROMPT, max_tokens=24).choices[0].text
    server = start_server(_args(tiny_model, tmp_path / "cache"), tmp_path / "serve.log")
    try:
        wait_for_health(server, 200, timeout=180)
        child = _wait_for_child(server)
        deadline = time.monotonic() + 30  # the child lowers its priority first thing, once Python is up
        while not (os.sched_getscheduler(child.pid) == os.SCHED_IDLE or child.nice() == 19):
            assert time.monotonic() < deadline, "the compile child kept its normal CPU priority"
            time.sleep(0.01)  # polling another process's scheduling class
        client = openai_client(server)
        for _ in range(3):  # served while the child compiles, with the eager server's tokens
            assert greedy(client, PROMPT, max_tokens=24).choices[0].text == want
        assert child.is_running() and _info(server)["compiled_buckets"] != BUCKETS, "compiled before we looked"
        assert sum(_steps(server).values()) == 3 * 23  # every decode step ran, eagerly or in a ready bucket

        deadline = time.monotonic() + 600
        while (info := _info(server))["compiled_buckets"] != BUCKETS:
            assert time.monotonic() < deadline, f"buckets never all loaded:\n{server.log()[-3000:]}"
            assert server.proc.poll() is None
            time.sleep(0.2)  # bounded poll of another process's progress
        assert set(info["compile_seconds"]) == {str(b) for b in BUCKETS}
        # The child compiled everything: no bucket fell back to a compile in the server process.
        assert info["bucket_sources"] == {str(b): "compile child" for b in BUCKETS}
        assert _gone(child), "the compile child did not exit after its last bucket"
        saved = sorted(p.name for p in (tmp_path / "cache" / "decode-steps").glob("*/bucket-*.bin"))
        assert saved == [f"bucket-{b}.bin" for b in BUCKETS]
        before = _steps(server)
        assert greedy(client, PROMPT, max_tokens=24).choices[0].text == want
        after = _steps(server)
        assert after["1"] - before["1"] == 23  # the loaded bucket ran every decode step of the request
    finally:
        stop_server(server)
    assert server.proc.returncode == 0


def test_sigterm_mid_compile_ends_the_child_and_exits_0(tiny_model: Path, tmp_path: Path) -> None:
    server = start_server(_args(tiny_model, tmp_path / "cache"), tmp_path / "serve.log")
    try:
        wait_for_health(server, 200, timeout=180)
        child = _wait_for_child(server)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        assert time.monotonic() - t0 < 10.0
        assert _gone(child, 5.0), "the compile child outlived the server"
    finally:
        stop_server(server)


def test_sigkill_of_the_server_ends_the_child(tiny_model: Path, tmp_path: Path) -> None:
    """The child reads its stdin until EOF: however the server dies, its pipe closes and the child exits."""
    server = start_server(_args(tiny_model, tmp_path / "cache"), tmp_path / "serve.log")
    try:
        wait_for_health(server, 200, timeout=180)
        child = _wait_for_child(server)
        server.proc.kill()
        server.proc.wait(30)
        assert _gone(child, 20.0), "the compile child outlived a killed server"
    finally:
        stop_server(server)


def _steps(server: Server) -> dict[str, float]:
    """ember:decode_steps per bucket label ("0": eager steps)."""
    out = {}
    for key, value in metrics(server).items():
        if key.startswith("ember:decode_steps_total{") or key.startswith("ember:decode_steps{"):
            out[key.split('bucket="')[1].split('"')[0]] = value
    return out
