"""`ember bench --workload multi-turn`: chat-shaped traffic where prefix caching pays, for any OpenAI server.

C conversations run at once, each T turns in sequence. Every conversation starts with the same S-token system
prompt; turn k's prompt is the system prompt, then each earlier turn's user message (U seeded tokens) and the
reply the server streamed for it (its text, re-tokenized by the server's own tokenizer, as a chat client sends
history back), then turn k's user message. Prompts are token ids sent to /v1/completions, so every server sees
the same tokens without chat-template differences.

Before the conversations, a probe measures the target figure alone on the server: a fresh S-token prefix with
a U-token suffix (nothing cached), then the same prefix with another suffix (the prefix cached), three times
with distinct prefixes; the report gives the median TTFT of each and their ratio.

Like load.py this imports neither torch nor the engine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from server.bench.client import RequestResult, RequestSpec, stream_completion
from server.bench.prompts import PromptError, Tokenizer, find_tokenizer, token_stream, tokenize
from server.bench.report import percentile
from server.bench.rss import ServerMonitor

PROBES = 3
# The workload's shape, shared by `ember bench`'s flags and scripts/bench_peers.py's pass-through flags.
DEFAULTS = {"conversations": 8, "turns": 6, "system_len": 1000, "user_len": 64}
PROBE_TOKENS = 4  # TTFT is what the probe measures; a few tokens keep it short


@dataclass(frozen=True)
class MultiTurnReport:
    label: str
    model: str
    conversations: int
    turns: int
    system_len: int
    user_len: int
    max_tokens: int
    requests: int
    errors: int
    wall_s: float
    output_tokens: int
    output_tokens_per_s: float
    prompt_tokens: int  # summed over turns, as sent
    cached_tokens: int | None  # summed usage.prompt_tokens_details.cached_tokens, where the server reports it
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_first_turn_p50_ms: float
    ttft_later_turns_p50_ms: float
    itl_mean_ms: float
    probe_uncached_ttft_ms: float
    probe_cached_ttft_ms: float
    probe_ratio: float  # cached / uncached: the prefix cache's effect on one request, alone
    peak_rss_mb: float | None
    other_cpu_s: float | None


async def _reply_ids(client: httpx.AsyncClient, tok: Tokenizer, model: str, text: str) -> list[int]:
    ids = await tokenize(client, tok, model, text) if text else []
    if ids is None:
        raise PromptError(f"{tok.path} stopped answering while re-tokenizing a reply")
    return ids


async def _conversation(client: httpx.AsyncClient, tok: Tokenizer, spec: RequestSpec, system: list[int],
                        users: list[list[int]]) -> list[RequestResult]:
    history = list(system)
    results = []
    for user in users:
        history += user
        res = await stream_completion(client, spec, history)
        results.append(res)
        if res.error is not None:
            break  # the conversation cannot go on without its reply
        history += await _reply_ids(client, tok, spec.model, res.text)
    return results


async def _probe(client: httpx.AsyncClient, model: str, stream: list[int], system_len: int,
                 user_len: int) -> tuple[float, float]:
    """Median TTFT (ms) of a fresh prefix and of the same prefix again with a new suffix, alone on the server."""
    spec = RequestSpec(model, PROBE_TOKENS, 0.0)
    cold, warm = [], []
    for i in range(PROBES):
        base = i * (system_len + 2 * user_len)
        prefix = stream[base : base + system_len]
        tails = (stream[base + system_len : base + system_len + user_len],
                 stream[base + system_len + user_len : base + system_len + 2 * user_len])
        for tail, out in zip(tails, (cold, warm)):
            res = await stream_completion(client, spec, prefix + tail)
            if res.error is not None or res.ttft is None:
                raise PromptError(f"probe request failed: {res.error}")
            out.append(res.ttft * 1e3)
    return statistics.median(cold), statistics.median(warm)


async def run_multi_turn(args: argparse.Namespace, model: str, client: httpx.AsyncClient) -> MultiTurnReport:
    c, t, s, u = args.conversations, args.turns, args.system_len, args.user_len
    if min(c, t, s, u, args.max_tokens) < 1:
        raise ValueError("--conversations, --turns, --system-len, --user-len and --max-tokens must be positive")
    tok = await find_tokenizer(client, model)
    if tok is None:
        raise PromptError("the multi-turn workload re-tokenizes replies: the server needs a tokenize endpoint")
    probe_need = PROBES * (s + 2 * u)
    stream = await token_stream(client, tok, model, args.seed, probe_need + s + c * t * u)
    system = stream[probe_need : probe_need + s]
    users = [[stream[probe_need + s + (k * t + j) * u : probe_need + s + (k * t + j + 1) * u] for j in range(t)]
             for k in range(c)]
    spec = RequestSpec(model, args.max_tokens, args.temperature)
    monitor = ServerMonitor(args.pid)
    monitor.start()
    try:
        await stream_completion(client, RequestSpec(model, PROBE_TOKENS, 0.0), stream[:16])  # warm-up
        cold, warm = await _probe(client, model, stream, s, u)
        t0 = time.perf_counter()
        convs = await asyncio.gather(*(_conversation(client, tok, spec, system, users[k]) for k in range(c)))
        wall = time.perf_counter() - t0
    finally:
        await monitor.stop()
    flat = [r for conv in convs for r in conv]
    ok = [r for r in flat if r.error is None]
    ttft = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    first = [conv[0].ttft * 1e3 for conv in convs if conv and conv[0].error is None and conv[0].ttft is not None]
    later = [r.ttft * 1e3 for conv in convs for r in conv[1:] if r.error is None and r.ttft is not None]
    itl = [r.inter_token_latency * 1e3 for r in ok if r.inter_token_latency is not None]
    cached = [r.usage_cached_tokens for r in ok if r.usage_cached_tokens is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    has_pid = args.pid is not None
    return MultiTurnReport(
        label=args.label, model=model, conversations=c, turns=t, system_len=s, user_len=u,
        max_tokens=args.max_tokens, requests=c * t, errors=c * t - len(ok),
        wall_s=wall, output_tokens=out_tokens, output_tokens_per_s=out_tokens / wall if wall > 0 else 0.0,
        prompt_tokens=sum(r.usage_prompt_tokens or 0 for r in ok), cached_tokens=sum(cached) if cached else None,
        ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
        ttft_first_turn_p50_ms=percentile(first, 50), ttft_later_turns_p50_ms=percentile(later, 50),
        itl_mean_ms=sum(itl) / len(itl) if itl else float("nan"),
        probe_uncached_ttft_ms=cold, probe_cached_ttft_ms=warm, probe_ratio=warm / cold,
        peak_rss_mb=monitor.peak_rss_bytes / 2**20 if has_pid else None,
        other_cpu_s=monitor.other_cpu_seconds if has_pid else None,
    )


def format_multi_turn(r: MultiTurnReport) -> str:
    cached = "n/a" if r.cached_tokens is None else f"{r.cached_tokens} ({r.cached_tokens / max(r.prompt_tokens, 1):.0%})"
    rss = "n/a" if r.peak_rss_mb is None else f"{r.peak_rss_mb:.0f} MiB"
    return "\n".join([
        f"{r.label}: {r.conversations} conversations x {r.turns} turns, {r.system_len}-token shared system prompt, "
        f"{r.user_len}-token user turns, {r.max_tokens} output tokens",
        f"  requests {r.requests}, errors {r.errors}, wall {r.wall_s:.1f} s, output {r.output_tokens_per_s:.1f} tok/s",
        f"  TTFT p50 {r.ttft_p50_ms:.0f} ms (first turns {r.ttft_first_turn_p50_ms:.0f}, later turns "
        f"{r.ttft_later_turns_p50_ms:.0f}), p99 {r.ttft_p99_ms:.0f} ms, ITL {r.itl_mean_ms:.1f} ms",
        f"  prompt tokens {r.prompt_tokens}, reported cached {cached}, peak RSS {rss}",
        f"  probe alone: uncached TTFT {r.probe_uncached_ttft_ms:.0f} ms, cached prefix {r.probe_cached_ttft_ms:.0f} ms "
        f"(ratio {r.probe_ratio:.3f})",
    ])


def format_multi_turn_comparison(folder: Path) -> str:
    """Medians per server over the multi-turn JSON reports in `folder` (scripts/bench_peers.py's output)."""
    by_server: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        if data.get("workload") == "multi-turn":
            by_server.setdefault(data["label"], []).append(data)
    cols = [("output_tokens_per_s", "tok/s", ".1f"), ("ttft_p50_ms", "TTFT p50 ms", ".0f"),
            ("ttft_first_turn_p50_ms", "turn-1 TTFT", ".0f"), ("ttft_later_turns_p50_ms", "turn 2+ TTFT", ".0f"),
            ("itl_mean_ms", "ITL ms", ".1f"), ("probe_uncached_ttft_ms", "probe cold ms", ".0f"),
            ("probe_cached_ttft_ms", "probe cached ms", ".0f"), ("probe_ratio", "cached/cold", ".3f"),
            ("peak_rss_mb", "peak RSS MiB", ".0f")]
    lines = ["| server | runs | " + " | ".join(c[1] for c in cols) + " |", "|" + " --- |" * (len(cols) + 2)]
    for label, runs in by_server.items():
        cells = []
        for key, _, fmt in cols:
            vals = [r[key] for r in runs if r.get(key) is not None]
            cells.append(format(statistics.median(vals), fmt) if vals else "n/a")
        lines.append(f"| {label} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_multi_turn_json(path: str, report: MultiTurnReport) -> None:
    with open(path, "w") as f:
        json.dump({"workload": "multi-turn", **asdict(report)}, f, indent=2)
        f.write("\n")
