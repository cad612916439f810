"""The figures `ember bench` reports, computed from the measured requests (warm-up excluded)."""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from server.bench.client import RequestResult


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


@dataclass(frozen=True)
class RunInfo:
    """What was run: the workload and where it went."""

    label: str
    base_url: str
    model: str
    concurrency: int
    prompt_len: int
    max_tokens: int
    prompt_source: str  # which endpoint tokenized the prompts, or "random"
    warmup_requests: int


@dataclass(frozen=True)
class BenchReport(RunInfo):
    """The run plus what was measured; its JSON is one flat object (server/bench/compare.py reads it by key)."""

    requests: int  # measured requests sent (warm-up excluded)
    errors: int
    output_tokens: int  # over requests without error
    tokens_from: str  # "usage", "chunks", or "mixed"
    mean_prompt_tokens: float  # as the server counted them (usage), NaN when it did not say
    wall_s: float  # first measured request sent -> last measured request done
    output_tokens_per_s: float
    request_per_s: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_mean_ms: float  # mean over requests of (last token - first token) / (tokens - 1)
    peak_rss_mb: float | None  # of --pid and its descendants, sampled every 100 ms (warm-up included)
    # CPU seconds from the first warm-up request to the last measured one (all cores): the server tree's, this
    # client's, and everyone else's (machine busy time minus both), which should be ~0 for a valid comparison.
    server_cpu_s: float | None
    client_cpu_s: float
    other_cpu_s: float | None
    error_messages: list[str]

    def to_json(self) -> dict[str, Any]:
        # NaN is not JSON: absent figures are null.
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


def summarize(info: RunInfo, results: Sequence[RequestResult], wall_s: float, peak_rss_bytes: int | None,
              server_cpu_s: float | None, client_cpu_s: float, other_cpu_s: float | None) -> BenchReport:
    ok = [r for r in results if r.error is None]
    ttfts = [t for r in ok if (t := r.ttft) is not None]
    itls = [t for r in ok if (t := r.inter_token_latency) is not None]
    sources = {r.tokens_from for r in ok}
    prompt_counts = [r.usage_prompt_tokens for r in ok if r.usage_prompt_tokens is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    errors = [r.error for r in results if r.error is not None]
    return BenchReport(
        **asdict(info), requests=len(results), errors=len(errors), output_tokens=out_tokens,
        tokens_from=sources.pop() if len(sources) == 1 else ("mixed" if sources else "none"),
        mean_prompt_tokens=_mean([float(c) for c in prompt_counts]), wall_s=wall_s,
        output_tokens_per_s=out_tokens / wall_s if wall_s > 0 else math.nan,
        request_per_s=len(ok) / wall_s if wall_s > 0 else math.nan,
        ttft_mean_ms=1000 * _mean(ttfts), ttft_p50_ms=1000 * percentile(ttfts, 50),
        ttft_p99_ms=1000 * percentile(ttfts, 99), itl_mean_ms=1000 * _mean(itls),
        peak_rss_mb=None if peak_rss_bytes is None else peak_rss_bytes / 2**20,
        server_cpu_s=server_cpu_s, client_cpu_s=client_cpu_s, other_cpu_s=other_cpu_s,
        error_messages=sorted(set(errors))[:5],
    )


def _fmt(v: Any, unit: str = "") -> str:
    if v is None or isinstance(v, float) and math.isnan(v):
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}{unit}" if abs(v) >= 10 else f"{v:.2f}{unit}"
    return f"{v}{unit}"


def format_table(r: BenchReport) -> str:
    rows = [
        ("server", f"{r.label} {r.base_url} model={r.model}"),
        ("workload", f"{r.concurrency} clients, {r.prompt_len}-token prompts ({r.prompt_source}), "
                     f"{r.max_tokens} output tokens, {r.warmup_requests} warm-up requests"),
        ("requests", f"{r.requests} ({r.errors} errors)"),
        ("output tokens", f"{r.output_tokens} (counted from {r.tokens_from})"),
        ("prompt tokens (server)", _fmt(r.mean_prompt_tokens)),
        ("wall time", _fmt(r.wall_s, " s")),
        ("output tokens/s", _fmt(r.output_tokens_per_s)),
        ("requests/s", _fmt(r.request_per_s)),
        ("TTFT mean / p50 / p99", f"{_fmt(r.ttft_mean_ms)} / {_fmt(r.ttft_p50_ms)} / {_fmt(r.ttft_p99_ms)} ms"),
        ("inter-token latency", _fmt(r.itl_mean_ms, " ms")),
        ("server peak RSS", _fmt(r.peak_rss_mb, " MiB")),
        ("CPU server / client / other", f"{_fmt(r.server_cpu_s)} / {_fmt(r.client_cpu_s)} / {_fmt(r.other_cpu_s)} s"),
    ]
    rows += [("error", m) for m in r.error_messages]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def write_json(path: str, report: BenchReport) -> None:
    with open(path, "w") as f:
        json.dump(report.to_json(), f, indent=2)
        f.write("\n")
