"""GET /v1/loads: the engine's load in the shape the Shepherd Model Gateway (`smg`, the SGLang router) reads from
a generic worker, for its `power_of_two` and `least_load` policies and `cache_aware`'s KV-pressure gates.

smg polls `GET /v1/loads?include=core,disagg,queues,memory` every 10 s for every worker whose runtime it has
classed as `generic` (model_gateway/src/worker/monitor.rs, `probe_native_loads`) and deserializes the body with
serde into `WorkerLoadResponse` / `SchedulerLoadSnapshot` (crates/protocols/src/worker.rs); smg 1.13.0 did so
with this module's answer when tried by hand (its /loads then showed our numbers). Consequences for the shape:
- every field is optional there (`#[serde(default)]`), so we send only what we measure; but a body that does
  not parse as that struct is taken as "no loads endpoint here" and never polled again, so the types are
  strict: the `int` fields are JSON integers (serde refuses 3.0 for an i32) and `timestamp` / `version` are
  strings, never null;
- an empty `loads` list reads as "no data yet": we always report one rank (Ember has no data parallelism);
- sections it asks for that we do not have (disagg, queues, memory) are simply absent, which it accepts.

The numbers are the same ones /metrics exports (server/api/metrics.py), from the engine's latest published
snapshot (engine/stats.py).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from datetime import UTC, datetime

from pydantic import BaseModel

from engine.stats import EngineInfo, EngineStats

# SGLang's section names (its /v1/loads `include`); smg sends core,disagg,queues,memory. Ember reports `core`.
SECTIONS = frozenset({"all", "core", "memory", "spec", "lora", "disagg", "queues"})
THROUGHPUT_WINDOW_S = 10.0  # gen_throughput is averaged over about this long (smg polls every 10 s by default)


class SchedulerLoad(BaseModel):
    """One rank: smg's `SchedulerLoadSnapshot` (crates/protocols/src/worker.rs); who reads each field is noted."""

    dp_rank: int = 0  # DP-rank load cache key (worker/monitor.rs `WorkerLoadManager`, dp_rank_loads())
    num_running_reqs: int  # sequences in the batch, prefilling or decoding (= ember:num_requests_running)
    # sequences queued for admission (= ember:num_requests_waiting); policies/least_load.rs `queued_tokens`
    # (as waiting x mean prefill when no token count is given) and its `max_waiting_requests` veto
    num_waiting_reqs: int
    # prompt tokens still to prefill: waiting sequences in full (prefix-cache hits are only known at admission,
    # so an upper bound, as SGLang's own estimate when it skips matching) plus the rest of half-prefilled ones;
    # least_load.rs `queued_tokens` prefers this to the request count
    num_waiting_uncached_tokens: int
    num_total_reqs: int  # running + waiting
    num_used_tokens: int  # KV slots held by admitted requests (= ember:kv_pool_used_slots); DP cache, smg's /loads
    # KV pool size in tokens (= ember:kv_pool_total_slots); > 0 marks the token counts as real
    # (`has_absolute_token_data`)
    max_total_num_tokens: int
    # num_used_tokens / max_total_num_tokens (= ember:kv_pool_usage_perc); least_load.rs and power_of_two.rs
    # score KV pressure k / (1 - k) from it (`effective_token_usage`), cache_aware.rs's overload and KV-spread
    # gates compare it across workers
    token_usage: float
    gen_throughput: float  # generated tokens/s over the last ~10 s; least_load.rs divides queued work by it
    cache_hit_rate: float  # prefix-cache hit tokens / looked-up tokens since start (= ember:prefix_cache_hit_rate)
    utilization: float  # num_running_reqs / max_running_requests (SGLang reports 0 here)
    # --max-running-requests; smg's capacity tracker reads it from /get_server_info (worker/capacity.rs)
    max_running_requests: int


class WorkerLoads(BaseModel):
    """smg's `WorkerLoadResponse` (crates/protocols/src/worker.rs): it needs a non-empty `loads`."""

    timestamp: str  # ISO 8601, UTC, when this answer was made
    version: str  # Ember's version
    dp_rank_count: int = 1
    loads: list[SchedulerLoad]


class ThroughputMeter:
    """Generated tokens per second between polls of a monotonically growing counter.

    Each poll records (time, count) and answers the rate since the newest sample at least THROUGHPUT_WINDOW_S
    old (or the oldest one, early on), so the rate covers about one poll interval of a 10 s poller; the first
    poll answers 0.0. Polls can come from several clients at once: a lock guards the samples.
    """

    def __init__(self, window_s: float = THROUGHPUT_WINDOW_S) -> None:
        self._window = window_s
        # bounded for a client that polls in a tight loop: the baseline then gets younger, nothing breaks
        self._samples: deque[tuple[float, int]] = deque(maxlen=1024)
        self._lock = threading.Lock()

    def rate(self, count: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            samples = self._samples
            while len(samples) >= 2 and now - samples[1][0] >= self._window:
                samples.popleft()  # samples[1] is old enough to be the baseline itself
            base = samples[0] if samples else None
            samples.append((now, count))
        if base is None or now <= base[0]:
            return 0.0
        return max(count - base[1], 0) / (now - base[0])


def include_is_valid(include: str | None) -> bool:
    """Every name in the comma-separated `include` is one of SGLang's sections (else the route answers 400)."""
    return {s.strip() for s in (include or "").split(",") if s.strip()} <= SECTIONS


def load_snapshot(info: EngineInfo, stats: EngineStats, meter: ThroughputMeter, version: str) -> WorkerLoads:
    running, waiting, kv_total, used = stats.running, stats.waiting, info.kv_slots, stats.kv_used_slots
    max_running = info.max_running_requests
    rank = SchedulerLoad(
        num_running_reqs=running, num_waiting_reqs=waiting, num_waiting_uncached_tokens=stats.waiting_uncached_tokens,
        num_total_reqs=running + waiting, num_used_tokens=used, max_total_num_tokens=kv_total,
        token_usage=round(used / max(kv_total, 1), 4),
        gen_throughput=round(meter.rate(stats.generation_tokens), 2),
        cache_hit_rate=round(stats.prefix_hit_rate, 4),
        utilization=round(running / max(max_running, 1), 4), max_running_requests=max_running)
    return WorkerLoads(timestamp=datetime.now(UTC).isoformat(), version=version, loads=[rank])
