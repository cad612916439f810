"""The soak's records (a replica's lives, its faults, each request's attempts) and the verdict on them: the checks
scripts/soak.py's docstring lists, the JSON summary and its printout."""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from router_harness import Replica
from server_harness import idle
from soak_http import Attempt

if TYPE_CHECKING:
    from soak import Soak

RSS_BOUND_MIB = 150.0
RSS_BOUND_FRAC = 0.25
FAULT_GRACE_S = 5.0  # after smg reports the replica healthy again: requests routed just before still drain


# ---- records ------------------------------------------------------------------------------------------------
@dataclass
class Life:
    """One process of a replica: a restarted replica gets a new one."""
    pid: int
    rss_start_mib: float
    rss_end_mib: float = 0.0
    rss_peak_mib: float = 0.0
    ended: str = "running"  # running | drained | killed
    samples: list[float] = field(default_factory=list)  # RSS every ~5 s: a plateau or a slope

    @property
    def growth_mib(self) -> float:
        return self.rss_end_mib - self.rss_start_mib

    def bound_mib(self) -> float:
        return max(RSS_BOUND_MIB, RSS_BOUND_FRAC * self.rss_start_mib)


@dataclass
class Fault:
    kind: str  # drain | kill
    replica: int
    t_signal: float
    t_healthy: float = float("inf")
    detail: dict[str, Any] = field(default_factory=dict)

    def covers(self, t0: float, t1: float) -> bool:
        return t0 <= self.t_healthy + FAULT_GRACE_S and t1 >= self.t_signal


@dataclass
class Request:
    kind: str
    attempts: list[Attempt]
    greedy_key: str | None = None


FINISHED_RE = re.compile(r"request (\S+) finished: .* finish_reason=(\w+)")


def finished_in_log(replica: Replica, offset: int, skip: set[str]) -> Counter[str]:
    """Finish reasons of the requests logged since `offset` but those in `skip`: the log is appended across
    restarts, unlike /metrics, so it counts every life of the replica."""
    text = replica.log_path.read_text(errors="replace")[offset:]
    return Counter(reason for rid, reason in FINISHED_RE.findall(text) if rid not in skip)


def log_errors(replica: Replica, offset: int) -> list[str]:
    text = replica.log_path.read_text(errors="replace")[offset:]
    return [line[:300] for line in text.splitlines() if "unhandled error" in line or "Traceback" in line
            or " ERROR " in line]


# ---- verdict -------------------------------------------------------------------------------------------------
def judge(soak: Soak, end_metrics: dict[int, dict[str, float]], problems_solo: list[str]) -> dict[str, Any]:
    reqs = soak.requests
    attempts = [a for r in reqs for a in r.attempts]
    violations: list[str] = list(soak.crashes)
    excused = doc503 = 0
    for r in reqs:
        for i, a in enumerate(r.attempts):
            last = i == len(r.attempts) - 1
            if a.status == 500:
                violations.append(f"{r.kind}: 500: {a.detail}")
            elif a.outcome == "invalid":
                violations.append(f"{r.kind}: invalid answer ({a.status}): {a.detail}")
            elif a.outcome == "doc503":
                doc503 += 1
            elif a.outcome == "fault":
                # a documented 503 is an allowed answer to the retry as to any request
                retried_ok = not last and r.attempts[-1].outcome in ("ok", "bad_ok", "aborted", "doc503")
                in_window = any(f.covers(a.t0, a.t1) for f in soak.faults)
                if retried_ok and in_window:
                    excused += 1
                else:
                    why = "its retry failed too" if not retried_ok else "outside any fault window"
                    violations.append(f"{r.kind}: {a.status} ({why}): {a.detail[:200]}")

    greedy_cmp = greedy_bad = partial_cmp = 0
    greedy_problems: list[str] = []
    for r in reqs:
        if r.greedy_key is None:
            continue
        solo = soak.solo[r.greedy_key]
        for a in r.attempts:
            if a.outcome == "ok":
                greedy_cmp += 1
                if a.texts != solo:
                    greedy_bad += 1
                    greedy_problems.append(f"{r.greedy_key}: {a.texts!r} != solo {solo!r}")
            elif a.texts:  # cut by the client or by a killed replica: what arrived is a prefix
                partial_cmp += 1
                if any(not solo.get(i, "").startswith(t) for i, t in a.texts.items()):
                    greedy_bad += 1
                    greedy_problems.append(f"{r.greedy_key} (partial): {a.texts!r} not a prefix of {solo!r}")

    not_idle = {i: {k: v for k, v in m.items() if k in KV_KEYS} for i, m in end_metrics.items() if not idle(m)}
    rss_bad = [f"replica {i} pid {life.pid}: +{life.growth_mib:.1f} MiB > {life.bound_mib():.0f}"
               for i, lives in soak.lives.items() for life in lives if life.growth_mib > life.bound_mib()]
    finished = {r.index: finished_in_log(r, soak.log_offsets[r.index], soak.warm_ids) for r in soak.cluster.replicas}
    served = {i: sum(f.values()) for i, f in finished.items()}
    errors = {r.index: log_errors(r, soak.log_offsets[r.index]) for r in soak.cluster.replicas}
    drains = [f for f in soak.faults if f.kind == "drain"]
    checks = {
        "no_5xx_beyond_documented": (not violations, violations[:20]),
        "no_errors_in_replica_logs": (not any(errors.values()), {i: e[:5] for i, e in errors.items() if e}),
        "kv_pool_and_queues_idle": (not not_idle, not_idle),
        "rss_growth_bounded": (not rss_bad, rss_bad),
        "greedy_equals_solo": (greedy_bad == 0 and not problems_solo and greedy_cmp > 0,
                               (problems_solo + greedy_problems)[:10]),
        "every_replica_served": (all(v > 0 for v in served.values()), served),
        "drain_clean": (all(f.detail.get("clean") for f in drains), [f.detail for f in drains]),
    }
    by_kind: dict[str, Counter[str]] = defaultdict(Counter)
    for r in reqs:
        by_kind[r.kind][r.attempts[-1].outcome] += 1
    aborts_engine = sum(f["abort"] for f in finished.values())
    return {
        "passed": all(ok for ok, _ in checks.values()),
        "checks": {k: {"passed": ok, "detail": d} for k, (ok, d) in checks.items()},
        "config": {"duration_s": soak.args.duration, "elapsed_s": round(soak.elapsed, 1),
                   "replicas": len(soak.cluster.replicas), "clients": soak.args.clients, "seed": soak.args.seed,
                   "context": soak.context, "long_prompt_chars": soak.long_chars,
                   "rss_bound": f"max({RSS_BOUND_MIB:.0f} MiB, {RSS_BOUND_FRAC:.0%} of start)"},
        "requests": len(reqs),
        "attempts": len(attempts),
        "requests_per_s": round(len(reqs) / soak.elapsed, 1),
        "status_counts": dict(Counter(str(a.status) for a in attempts)),
        "outcome_counts": dict(Counter(a.outcome for a in attempts)),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "retries": sum(len(r.attempts) - 1 for r in reqs),
        "retries_succeeded": sum(1 for r in reqs if len(r.attempts) > 1
                                 and r.attempts[-1].outcome in ("ok", "bad_ok", "aborted")),
        "faults_excused": excused,
        "documented_503": doc503,
        "violations": len(violations),
        "client_aborts": sum(1 for a in attempts if a.outcome == "aborted"),
        "engine_aborts": aborts_engine,
        "finish_reasons": dict(sum(finished.values(), Counter())),
        "greedy": {"comparisons": greedy_cmp, "partial_prefix_checks": partial_cmp, "mismatches": greedy_bad,
                   "specs": len(soak.specs)},
        "served_per_replica": served,
        "replicas": {i: [asdict(life) | {"growth_mib": round(life.growth_mib, 1)} for life in lives]
                     for i, lives in soak.lives.items()},
        "faults": [{"kind": f.kind, "replica": f.replica, **f.detail} for f in soak.faults],
        "restarts": len(soak.faults),
        "end_metrics": {i: {k: v for k, v in m.items() if k in KV_KEYS} for i, m in end_metrics.items()},
    }


KV_KEYS = ("ember:kv_pool_used_slots", "ember:num_requests_running", "ember:num_requests_waiting")


def print_summary(s: dict[str, Any]) -> None:
    c = s["config"]
    print(f"\n=== soak: {c['replicas']} replicas, {c['clients']} clients, {c['elapsed_s']} s "
          f"(context {c['context']}, long prompts {c['long_prompt_chars']} chars) ===")
    print(f"requests {s['requests']} ({s['requests_per_s']}/s), attempts {s['attempts']}, retries {s['retries']} "
          f"({s['retries_succeeded']} succeeded), excused faults {s['faults_excused']}, documented 503s "
          f"{s['documented_503']}, violations {s['violations']}")
    print("status counts: " + ", ".join(f"{k}: {v}" for k, v in sorted(s["status_counts"].items())))
    print("outcomes:      " + ", ".join(f"{k}: {v}" for k, v in sorted(s["outcome_counts"].items())))
    for kind, out in s["by_kind"].items():
        print(f"  {kind:<11} " + ", ".join(f"{k}: {v}" for k, v in sorted(out.items())))
    print(f"client disconnects {s['client_aborts']}, engine aborts {s['engine_aborts']}, "
          f"finish reasons {s['finish_reasons']}")
    g = s["greedy"]
    print(f"greedy: {g['comparisons']} whole outputs and {g['partial_prefix_checks']} partial ones compared with "
          f"their solo runs ({g['specs']} specs), {g['mismatches']} mismatches")
    for f in s["faults"]:
        print(f"fault: {f['kind']} replica {f['replica']}: " + ", ".join(f"{k}={v}" for k, v in f.items()
                                                                            if k not in ("kind", "replica")))
    print(f"{'replica':<8} {'pid':>8} {'ended':>8} {'RSS start':>10} {'end':>8} {'peak':>8} {'growth':>8} "
          f"{'served':>7}  (MiB; served over all lives)")
    for i, lives in s["replicas"].items():
        for j, life in enumerate(lives):
            print(f"{i if j == 0 else '':<8} {life['pid']:>8} {life['ended']:>8} {life['rss_start_mib']:>10.1f} "
                  f"{life['rss_end_mib']:>8.1f} {life['rss_peak_mib']:>8.1f} {life['growth_mib']:>+8.1f} "
                  f"{s['served_per_replica'][i] if j == 0 else '':>7}")
    print("checks:")
    for name, chk in s["checks"].items():
        print(f"  [{'PASS' if chk['passed'] else 'FAIL'}] {name}" + ("" if chk["passed"] else f": {chk['detail']}"))
    print("SOAK PASSED" if s["passed"] else "SOAK FAILED")
