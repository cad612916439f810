"""`ember bench`: a closed-loop load generator for any OpenAI-compatible server (Ember, vLLM, llama-server).

N client tasks each send one streaming /v1/completions request at a time until the measured requests run out,
so N requests are in flight at every moment but the tail. Every request has a prompt of exactly P tokens
(prompts.py) and produces exactly M tokens (`ignore_eos`, greedy). Warm-up requests run first, at the same
concurrency, and are not counted; the server's process tree is monitored throughout (rss.py).

This module imports neither torch nor the engine: the client shares the machine with the server it measures.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Sequence

import httpx
import psutil

from server.bench.client import RequestResult, RequestSpec, stream_completion
from server.bench.copy_workloads import copy_prompts
from server.bench.multiturn import DEFAULTS as MULTI_TURN_DEFAULTS
from server.bench.multiturn import MultiTurnReport, format_multi_turn, run_multi_turn, write_multi_turn_json
from server.bench.prompts import PromptError, build_prompts
from server.bench.report import BenchReport, RunInfo, format_table, summarize, write_json
from server.bench.rss import ServerMonitor


def add_load_bench_args(p: argparse.ArgumentParser) -> None:
    # dests are prefixed: `model` and `api_key` are also server settings, which the EMBER_* environment and
    # --config files resolve; the load generator's own flags must not pick those up.
    g = p.add_argument_group("load")
    g.add_argument("--base-url", dest="bench_base_url", metavar="URL", default="http://127.0.0.1:8000",
                   help="the server's root URL; a trailing /v1 is ignored (default: %(default)s)")
    g.add_argument("--model", dest="bench_model", metavar="MODEL", default=None,
                   help="model id to request (default: the first one /v1/models lists)")
    g.add_argument("--api-key", dest="bench_api_key", metavar="KEY", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--concurrency", "-n", type=int, default=1, help="concurrent streaming clients (default: %(default)s)")
    g.add_argument("--num-requests", type=int, default=None, help="measured requests (default: 4 x concurrency)")
    g.add_argument("--warmup-requests", type=int, default=None,
                   help="requests sent first and not counted (default: the concurrency)")
    g.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default: %(default)s)")
    g.add_argument("--max-tokens", type=int, default=128,
                   help="output tokens per request, with ignore_eos (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seed of the prompts (default: %(default)s)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="send seeded random ids below this when the server has no tokenize endpoint")
    g.add_argument("--pid", type=int, default=None, help="server process whose peak RSS (with its children) to report")
    g.add_argument("--label", default="server", help="name of the server in the report (default: %(default)s)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: %(default)s)")
    g.add_argument("--json", dest="bench_json", default=None, metavar="FILE", help="also write the report as JSON")
    m = p.add_argument_group("multi-turn workload (server/bench/multiturn.py)")
    m.add_argument("--workload", choices=["fixed", "multi-turn", "edit", "extract"], default="fixed",
                   help="fixed: N clients, distinct P-token prompts of free text; multi-turn: conversations sharing "
                        "a system prompt, each turn resending the history; edit / extract: answers mostly copied "
                        "from the prompt (rewrite code, quote a document: server/bench/copy_workloads.py) "
                        "(default: %(default)s)")
    for name, doc in (("conversations", "concurrent conversations"), ("turns", "turns per conversation"),
                      ("system_len", "shared system prompt tokens"), ("user_len", "tokens per user message")):
        m.add_argument("--" + name.replace("_", "-"), type=int, default=MULTI_TURN_DEFAULTS[name],
                       help=f"{doc} (default: %(default)s)")


def root_url(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def first_model(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


async def run_phase(client: httpx.AsyncClient, spec: RequestSpec, prompts: Sequence[list[int]],
                    concurrency: int) -> list[RequestResult]:
    """Send every prompt, `concurrency` at a time; results in completion order."""
    pending = list(reversed(prompts))  # pop() from the end = send in order
    results: list[RequestResult] = []

    async def worker() -> None:
        while pending:  # single-threaded event loop: check-then-pop cannot race
            results.append(await stream_completion(client, spec, pending.pop()))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    return results


def http_client(args: argparse.Namespace, connections: int) -> httpx.AsyncClient:
    """The client every workload uses: the server's root URL, the API key, room for `connections` streams."""
    headers = {"Authorization": f"Bearer {args.bench_api_key}"} if args.bench_api_key else {}
    limits = httpx.Limits(max_connections=connections + 2, max_keepalive_connections=connections + 2)
    # trust_env=False: a proxy from the environment must never sit between the client and a local server.
    return httpx.AsyncClient(base_url=root_url(args.bench_base_url), headers=headers, limits=limits,
                             timeout=httpx.Timeout(args.timeout), trust_env=False)


async def run_load(args: argparse.Namespace) -> BenchReport:
    n = args.concurrency
    num_requests = args.num_requests if args.num_requests is not None else 4 * n
    warmup = args.warmup_requests if args.warmup_requests is not None else n
    if n < 1 or num_requests < 1 or warmup < 0 or args.max_tokens < 1:
        raise ValueError("--concurrency, --num-requests and --max-tokens must be positive, --warmup-requests >= 0")
    async with http_client(args, n) as client:
        model = args.bench_model or await first_model(client)
        if args.workload in ("edit", "extract"):
            prompts, source = await copy_prompts(client, model, args.workload, args.prompt_len,
                                                 warmup + num_requests, args.seed)
        else:
            prompts, source = await build_prompts(client, model, args.prompt_len, warmup + num_requests, args.seed,
                                                  args.vocab_size)
        spec = RequestSpec(model, args.max_tokens, args.temperature)
        monitor = ServerMonitor(args.pid)
        monitor.start()
        try:
            await run_phase(client, spec, prompts[:warmup], n)
            t0 = time.perf_counter()
            results = await run_phase(client, spec, prompts[warmup:], n)
            wall = time.perf_counter() - t0
        finally:
            await monitor.stop()
    info = RunInfo(args.label, root_url(args.bench_base_url), model, n, args.prompt_len, args.max_tokens, source,
                   warmup)
    has_pid = args.pid is not None
    return summarize(info, results, wall, monitor.peak_rss_bytes if has_pid else None,
                     monitor.server_cpu_seconds if has_pid else None, monitor.client_cpu_seconds,
                     monitor.other_cpu_seconds if has_pid else None)


async def _multi_turn(args: argparse.Namespace) -> MultiTurnReport:
    async with http_client(args, args.conversations) as client:
        model = args.bench_model or await first_model(client)
        return await run_multi_turn(args, model, client)


def run_load_bench(args: argparse.Namespace) -> int:
    """The `ember bench` command: 0 when every measured request succeeded, 1 otherwise, 2 when it cannot run."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would drown the table
    multi = args.workload == "multi-turn"
    try:
        report: BenchReport | MultiTurnReport = asyncio.run(_multi_turn(args) if multi else run_load(args))
    except (PromptError, ValueError, httpx.HTTPError, psutil.Error, KeyError, IndexError) as exc:
        print(f"ember bench: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if isinstance(report, MultiTurnReport):
        print(format_multi_turn(report))
        if args.bench_json:
            write_multi_turn_json(args.bench_json, report)
    else:
        print(format_table(report))
        if args.bench_json:
            write_json(args.bench_json, report)
    return 0 if report.errors == 0 else 1
