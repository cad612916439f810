"""The comparison table of scripts/bench_peers.py: `ember bench` JSON reports of several servers, repeated runs
folded into their median, and Ember's ratio to each peer.

Also a command, to print the table again from saved reports: `python -m server.bench.compare DIR [--ref ember]`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Cell:
    """The median of one server's repeated runs at one concurrency."""

    server: str
    concurrency: int
    runs: int
    errors: int
    tokens_per_s: float
    tokens_per_s_all: tuple[float, ...]
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_ms: float
    peak_rss_mb: float | None
    other_cpu_s: float  # the most any run saw: CPU used by others while it ran


def _median(values: Iterable[float | None]) -> float:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else float("nan")


def fold(reports: list[dict[str, Any]]) -> dict[tuple[str, int], Cell]:
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in reports:
        groups[(r["label"], r["concurrency"])].append(r)
    cells = {}
    for (server, c), rs in groups.items():
        rss = [r["peak_rss_mb"] for r in rs if r["peak_rss_mb"] is not None]
        cells[(server, c)] = Cell(
            server, c, len(rs), sum(r["errors"] for r in rs), _median(r["output_tokens_per_s"] for r in rs),
            tuple(round(r["output_tokens_per_s"], 1) for r in rs), _median(r["ttft_p50_ms"] for r in rs),
            _median(r["ttft_p99_ms"] for r in rs), _median(r["itl_mean_ms"] for r in rs),
            max(rss) if rss else None, max((r["other_cpu_s"] or 0.0) for r in rs))
    return cells


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None or v != v else f"{v:.{digits}f}"


def format_comparison(reports: list[dict[str, Any]], ref: str = "ember") -> str:
    """A markdown table per concurrency: each server's medians, then `ref`'s ratio to every other server
    (tokens/s: ref / peer, higher is better for ref; TTFT p50 and RSS: ref / peer, lower is better)."""
    cells = fold(reports)
    servers = list(dict.fromkeys(r["label"] for r in reports))
    lines = ["| clients | server | runs | errors | tok/s (median) | tok/s (each run) | TTFT p50 ms | TTFT p99 ms "
             "| ITL ms | peak RSS MiB | other CPU s |", "|" + " --- |" * 11]
    for c in sorted({k[1] for k in cells}):
        for s in servers:
            x = cells.get((s, c))
            if x is not None:
                lines.append(f"| {c} | {s} | {x.runs} | {x.errors} | {_f(x.tokens_per_s)} | "
                             f"{', '.join(map(str, x.tokens_per_s_all))} | {_f(x.ttft_p50_ms)} | {_f(x.ttft_p99_ms)} "
                             f"| {_f(x.itl_ms, 2)} | {_f(x.peak_rss_mb, 0)} | {_f(x.other_cpu_s)} |")
    lines += ["", f"{ref} / peer (tok/s: > 1 means {ref} is faster; TTFT and RSS: < 1 means {ref} is better)", "",
              "| clients | peer | tok/s ratio | TTFT p50 ratio | peak RSS ratio |", "| --- | --- | --- | --- | --- |"]
    for c in sorted({k[1] for k in cells}):
        mine = cells.get((ref, c))
        if mine is None:
            continue
        for s in servers:
            peer = cells.get((s, c))
            if s == ref or peer is None:
                continue
            rss = (mine.peak_rss_mb / peer.peak_rss_mb) if mine.peak_rss_mb and peer.peak_rss_mb else None
            lines.append(f"| {c} | {s} | {_f(mine.tokens_per_s / peer.tokens_per_s, 2)} | "
                         f"{_f(mine.ttft_p50_ms / peer.ttft_p50_ms, 2)} | {_f(rss, 2)} |")
    return "\n".join(lines)


def load_reports(folder: Path) -> list[dict[str, Any]]:
    """Every `ember bench` JSON report in `folder`, in file-name order (the runs' order for bench_peers)."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json")) if p.name != "summary.json"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.bench.compare", description=__doc__)
    p.add_argument("folder", type=Path, help="folder of `ember bench --json` reports")
    p.add_argument("--ref", default="ember", help="the server whose ratios to print (default: %(default)s)")
    args = p.parse_args(argv)
    reports = load_reports(args.folder)
    if not reports:
        print(f"no reports in {args.folder}", file=sys.stderr)
        return 2
    print(format_comparison(reports, args.ref))
    return 0


if __name__ == "__main__":
    sys.exit(main())
