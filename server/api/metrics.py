"""Prometheus metrics, prefix `ember:`, in a registry of our own (never the process-global default one).

Two sources: gauges and engine counters come from the engine's latest published snapshot at scrape time
(`EngineCollector` reads engine/stats.py's EngineInfo and EngineStats, never the scheduler itself, so no
bookkeeping of ours can drift from the engine's); latency histograms and per-request counters are fed by the
server from the outputs it receives (`observe_output`, `observe_finished`).

`--metrics-compat vllm` adds three gauges under vLLM's names with the same values as Ember's own, for tools that
know only those: the Gateway API Inference Extension's endpoint picker reads `vllm:num_requests_waiting`,
`vllm:num_requests_running` and `vllm:kv_cache_usage_perc` (0-1) unless configured otherwise. They are not on
by default: two names for one gauge double every dashboard query that matches on the metric name alone.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.outputs import RequestOutput
from engine.stats import EngineInfo, EngineStats

# The engine's facts and latest stats, or None before it is ready.
EngineView = Callable[[], tuple[EngineInfo, EngineStats] | None]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                    80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 32768)


class EngineCollector(Collector):
    """Engine state at scrape time; yields nothing until the engine is ready."""

    def __init__(self, view: EngineView, compat: str | None = None) -> None:
        self._view = view
        self._vllm = compat == "vllm"

    def describe(self) -> list[Metric]:
        return []  # registering must not trigger a collect before the engine exists

    def collect(self) -> Iterator[Metric]:
        view = self._view()
        if view is None:
            return
        info, stats = view
        running, waiting = stats.running, stats.waiting
        yield _gauge("ember:num_requests_running", "Requests in the batch (prefilling or decoding).", running)
        yield _gauge("ember:num_requests_waiting", "Requests queued for admission.", waiting)
        used = stats.kv_used_slots  # prefix-cache entries nobody holds are free space: evicted on demand
        usage = used / max(info.kv_slots, 1)
        yield _gauge("ember:kv_pool_usage_perc", "Fraction of KV pool slots held by admitted requests (0-1).", usage)
        if self._vllm:
            yield _gauge("vllm:num_requests_running", "ember:num_requests_running under vLLM's name.", running)
            yield _gauge("vllm:num_requests_waiting", "ember:num_requests_waiting under vLLM's name.", waiting)
            yield _gauge("vllm:kv_cache_usage_perc", "ember:kv_pool_usage_perc under vLLM's name (0-1).", usage)
        yield _gauge("ember:kv_pool_used_slots", "KV pool slots (tokens) held by admitted requests.", used)
        yield _gauge("ember:kv_pool_total_slots", "KV pool size in slots (tokens).", info.kv_slots)
        per_token = GaugeMetricFamily("ember:kv_bytes_per_token", "Bytes one token's K and V take in the pool, by KV "
                                      "dtype (--kv-cache-dtype; an int8 / fp8 cache's scales included).",
                                      labels=["dtype"])
        per_token.add_metric([info.kv_dtype], info.kv_bytes_per_token)
        yield per_token
        if info.window_slots:  # sliding-window layers in slots of their own (engine/window_slots.py)
            yield _gauge("ember:kv_window_total_slots", "Slots of the sliding-window layers' own K/V.",
                         info.window_slots)
            yield _gauge("ember:kv_window_used_slots", "Window-layer slots in use: positions in admitted requests' "
                         "windows and cached positions that kept theirs.", stats.window_used_slots)
            yield _counter("ember:kv_window_trimmed_tokens", "Window-layer slots given back by requests whose "
                           "window moved past the position.", stats.window_trimmed_tokens)
            yield _counter("ember:kv_window_reclaimed_tokens", "Window-layer slots taken from cached positions "
                           "because the window slots ran short.", stats.window_reclaimed_tokens)
        yield _gauge("ember:prefix_cache_slots", "KV slots holding prefix-cache entries (shared ones included).",
                     stats.prefix_cache_slots)
        yield _counter("ember:prefix_cache_hit_tokens", "Prompt tokens whose K/V came from the prefix cache.",
                       stats.prefix_hit_tokens)
        yield _counter("ember:prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.",
                       stats.prefix_queried_tokens)
        yield _counter("ember:prefix_cache_evicted_tokens", "Prefix-cache tokens evicted to make room.",
                       stats.prefix_evicted_tokens)
        yield _gauge("ember:prefix_cache_hit_rate", "prefix_cache_hit_tokens / prefix_cache_queried_tokens.",
                     stats.prefix_hit_rate)
        yield _counter("ember:prompt_tokens", "Prompt tokens prefilled (recomputation after retraction included).",
                       stats.prompt_tokens)
        yield _counter("ember:generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield _counter("ember:num_aborted_requests", "Sequences aborted (client gone, shutdown).", stats.aborted)
        yield _counter("ember:num_retractions", "Sequences retracted from the batch when the KV pool ran dry.",
                       stats.retractions)
        yield _counter("ember:prefill_steps", "Prefill forwards.", stats.prefill_steps)
        yield _counter("ember:grammar_mask_seconds", "Seconds spent computing and applying structured-output token "
                       "masks.", stats.grammar_mask_seconds)
        yield _counter("ember:grammar_masked_rows", "Sampled rows that a grammar constrained.",
                       stats.grammar_masked_rows)
        yield _gauge("ember:grammar_cache_entries", "Compiled grammars (schemas, regexes, tool formats) cached.",
                     stats.cached_grammars)
        if info.speculative != "off":  # one series per drafter (ngram today)
            for name, doc, value in (
                    ("proposed_tokens", "Speculative draft tokens verified.", stats.spec_proposed_tokens),
                    ("accepted_tokens", "Speculative draft tokens accepted.", stats.spec_accepted_tokens),
                    ("verify_steps", "Request-steps that verified drafts (accepted / this = mean accepted length).",
                     stats.spec_verify_steps)):
                family = CounterMetricFamily(f"ember:spec_{name}", doc, labels=["drafter"])
                family.add_metric([info.speculative], value)
                yield family
        disk = stats.kv_disk
        if disk is not None:  # the prefix cache's disk tier (--kv-disk-cache-size)
            yield _counter("ember:kv_disk_hit_blocks", "Disk-tier KV blocks read back into the pool.", disk.hit_blocks)
            yield _counter("ember:kv_disk_hit_tokens", "Prompt tokens whose K/V came from the disk tier.",
                           disk.hit_tokens)
            yield _counter("ember:kv_disk_miss_lookups", "Admissions that found no disk block past the cache's match.",
                           disk.miss_lookups)
            yield _counter("ember:kv_disk_written_bytes", "Bytes of KV blocks written to the disk tier.",
                           disk.written_bytes)
            yield _counter("ember:kv_disk_dropped_blocks", "KV blocks not written: the writer was behind.",
                           disk.dropped_blocks)
            yield _counter("ember:kv_disk_evicted_files", "Disk-tier files removed to stay within its size.",
                           disk.evicted_files)
            yield _counter("ember:kv_disk_bad_files", "Torn, foreign or corrupt disk-tier files removed.",
                           disk.bad_files)
            yield _gauge("ember:kv_disk_bytes", "Bytes the disk tier holds.", disk.bytes)
        steps = CounterMetricFamily("ember:decode_steps", "Decode steps run per batch-size bucket.", labels=["bucket"])
        for bucket, n in stats.steps_per_bucket:
            steps.add_metric([str(bucket)], n)
        yield steps
        compile_s = GaugeMetricFamily("ember:compile_seconds", "Seconds spent compiling (or warming) each decode "
                                      "bucket at start-up.", labels=["bucket"])
        for bucket, secs in stats.compile_seconds:
            compile_s.add_metric([str(bucket)], secs)
        yield compile_s


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    def __init__(self, view: EngineView, compat: str | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(view, compat))
        r = self.registry
        self.finished = Counter("ember:request_success", "Finished sequences by finish reason.", ["finish_reason"],
                                registry=r)
        self.ttft = Histogram("ember:time_to_first_token_seconds", "Time to first token.", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("ember:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("ember:e2e_request_latency_seconds", "Arrival to last token.", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.queue = Histogram("ember:request_queue_time_seconds", "Arrival to admission into the batch.",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_len = Histogram("ember:request_prompt_tokens", "Prompt length per request.",
                                    buckets=_TOKEN_BUCKETS, registry=r)
        self.output_len = Histogram("ember:request_generation_tokens", "Generated tokens per sequence.",
                                    buckets=_TOKEN_BUCKETS, registry=r)
        # Fed by server/api/http_metrics.py: every route, by its path template and the response status.
        self.http_requests = Counter("ember:http_requests", "HTTP requests by route and response status.",
                                     ["route", "status"], registry=r)
        for reason in ("stop", "length", "abort"):
            self.finished.labels(reason)  # export zeros from the start, so rates work from the first scrape

    def observe_gap(self, seconds: float, tokens: int) -> None:
        """One output of `tokens` new tokens arrived `seconds` after the previous output of the same sequence."""
        for _ in range(tokens):
            self.itl.observe(seconds / tokens)

    def observe_finished(self, out: RequestOutput) -> None:
        """The last output of one sequence (choice)."""
        self.finished.labels(out.finish_reason or "abort").inc()
        self.output_len.observe(out.completion_tokens)
        for key, hist in (("ttft", self.ttft), ("e2e", self.e2e), ("queue", self.queue)):
            if key in out.metrics:
                hist.observe(out.metrics[key])

    def observe_abandoned(self, sequences: int) -> None:
        """Sequences whose client left before they finished (their final output is never delivered to us)."""
        self.finished.labels("abort").inc(sequences)

    def render(self) -> bytes:
        return generate_latest(self.registry)
