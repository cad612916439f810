"""`ember bench` (server/bench/load.py): the load generator against a real `ember serve` on the tiny model, and
its SSE reader and statistics on canned input."""
from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import MakeTinyModel
from server_harness import API_KEY, MODEL_NAME, REPO, run_server, tiny_server_args

from server.bench.client import RequestResult, RequestSpec, stream_completion
from server.bench.prompts import windows
from server.bench.report import RunInfo, percentile, summarize

CLIENTS, PER_CLIENT, MAX_TOKENS, PROMPT_LEN = 2, 3, 8, 16


def test_bench_against_ember_serve(make_tiny_model: MakeTinyModel, tmp_path: Path) -> None:
    with run_server(tiny_server_args(make_tiny_model("llama")), tmp_path / "server.log") as server:
        out = tmp_path / "report.json"
        cmd = [sys.executable, "-m", "server.cli", "bench", "--base-url", server.base_url + "/v1",
               "--api-key", API_KEY, "--concurrency", str(CLIENTS), "--num-requests", str(CLIENTS * PER_CLIENT),
               "--warmup-requests", "2", "--prompt-len", str(PROMPT_LEN), "--max-tokens", str(MAX_TOKENS),
               "--pid", str(server.proc.pid), "--label", "ember", "--json", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    requests = CLIENTS * PER_CLIENT
    assert report["model"] == MODEL_NAME  # found through /v1/models
    assert report["requests"] == requests and report["warmup_requests"] == 2 and report["errors"] == 0
    assert report["output_tokens"] == requests * MAX_TOKENS and report["tokens_from"] == "usage"
    assert report["mean_prompt_tokens"] == PROMPT_LEN  # the server counted exactly P prompt tokens
    assert report["prompt_source"] == "/v1/tokenize:prompt"
    assert report["peak_rss_mb"] > 0 and report["server_cpu_s"] > 0
    assert 0 < report["ttft_p50_ms"] <= report["ttft_p99_ms"] and report["itl_mean_ms"] > 0
    assert report["output_tokens_per_s"] == pytest.approx(report["output_tokens"] / report["wall_s"])
    assert "output tokens/s" in done.stdout and "ember" in done.stdout


def test_bench_reports_unreachable_server() -> None:
    cmd = [sys.executable, "-m", "server.cli", "bench", "--base-url", "http://127.0.0.1:9", "--timeout", "5"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "ember bench: error" in done.stderr


# ---- one component on canned input ------------------------------------------------------------------------
def _stream(events: list[str]) -> RequestResult:
    body = "".join(f"data: {e}\n\n" for e in events).encode()
    transport = httpx.MockTransport(lambda req: httpx.Response(200, content=body))

    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await stream_completion(client, RequestSpec("m", 3, 0.0), [1, 2, 3])

    return asyncio.run(go())


def _chunk(text: str) -> str:
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": None}]})


def test_stream_counts_chunks_without_usage() -> None:
    # llama-server style: no usage chunk, a last chunk with an empty text and a finish reason.
    last = json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    r = _stream([_chunk("a"), _chunk("b"), _chunk("c"), last, "[DONE]"])
    assert r.error is None and r.output_tokens == 3 and r.tokens_from == "chunks"
    assert r.ttft is not None and r.ttft > 0 and r.inter_token_latency is not None


def test_stream_prefers_usage_and_flags_errors() -> None:
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}})
    r = _stream([_chunk("ab"), _chunk("c"), usage, "[DONE]"])
    assert r.output_tokens == 5 and r.usage_prompt_tokens == 3 and r.tokens_from == "usage"
    assert _stream([_chunk("a")]).error == "stream ended without data: [DONE]"
    err = _stream([_chunk("a"), json.dumps({"error": {"message": "boom"}}), "[DONE]"]).error
    assert err is not None and "boom" in err


def test_summary_excludes_failed_requests() -> None:
    ok = [RequestResult(start=0.0, end=2.0, first_token=0.5, last_token=1.5, usage_completion_tokens=11)
          for _ in range(3)]
    bad = RequestResult(start=0.0, end=0.1, error="HTTP 503: busy")
    info = RunInfo("x", "http://x", "m", 2, 4, 11, "random", 0)
    r = summarize(info, [*ok, bad], wall_s=4.0, peak_rss_bytes=2**20, server_cpu_s=1.0, client_cpu_s=0.1,
                  other_cpu_s=0.0)
    assert r.requests == 4 and r.errors == 1 and r.error_messages == ["HTTP 503: busy"]
    assert r.output_tokens == 33 and r.output_tokens_per_s == pytest.approx(33 / 4)
    assert r.ttft_p99_ms == pytest.approx(500) and r.itl_mean_ms == pytest.approx(100)
    assert r.peak_rss_mb == 1.0 and math.isnan(r.mean_prompt_tokens)


def test_percentile_interpolates() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert math.isnan(percentile([], 50))


def test_windows_are_distinct_and_exact() -> None:
    stream = list(range(40))
    prompts = windows(stream, 10, 31, seed=0)
    assert all(len(p) == 10 for p in prompts) and len({p[0] for p in prompts}) == 31
    assert prompts == windows(stream, 10, 31, seed=0)  # same seed, same prompts


def test_comparison_ratios() -> None:
    from server.bench.compare import format_comparison

    def rep(label: str, tps: float, ttft: float, rss: float) -> dict[str, object]:
        return {"label": label, "concurrency": 8, "errors": 0, "output_tokens_per_s": tps, "ttft_p50_ms": ttft,
                "ttft_p99_ms": ttft, "itl_mean_ms": 1.0, "peak_rss_mb": rss, "other_cpu_s": 0.0}

    reports = [rep("ember", 300.0, 50.0, 300.0), rep("peer", 200.0, 100.0, 200.0), rep("ember", 500.0, 30.0, 320.0)]
    text = format_comparison(reports, "ember")
    assert "| 8 | ember | 2 | 0 | 400.0 | 300.0, 500.0 |" in text  # median of the two ember runs
    assert "| 8 | peer | 2.00 | 0.40 | 1.60 |" in text  # 400/200, 40/100, max RSS 320/200
