"""What the server may know about the engine, without touching it: `EngineInfo` (fixed once the model is loaded) and
`EngineStats` (an immutable snapshot the engine thread publishes after every step and command).

Only the engine thread touches the scheduler, the KV manager and the runner (engine/engine_thread.py). /metrics,
/v1/loads, /get_server_info and the benchmarks read these two objects instead: a reference swap publishes a new
snapshot, so a reader sees one consistent step, never a queue being modified under it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.kv_disk import DiskStats
from engine.loader.model_config import ModelConfig
from engine.request import Pooling

if TYPE_CHECKING:
    from engine.core import EngineCore
    from engine.decode_graphs import DecodeGraphs


@dataclass(frozen=True)
class EngineInfo:
    model_config: ModelConfig
    max_context: int
    kv_slots: int
    kv_dtype: str  # --kv-cache-dtype, auto made concrete
    kv_bytes_per_token: int  # one token's K and V over the pool's layers (an int8 cache's scales included)
    max_running_requests: int
    decode_buckets: tuple[int, ...]
    compiled: bool
    packed_linear: bool
    weights_tag: str
    weight_bytes: int  # what the weights hold in memory
    file_bytes: int  # the checkpoint's weight files on disk
    quantized_formats: dict[str, int]  # quantized format -> weights in it
    pooling: Pooling  # how /v1/embeddings pools this model's hidden states
    hidden_size: int  # the embeddings' length
    # "ngram", "draft" or "off" (also off for a sliding-window model on rings: --disable-prefix-cache)
    speculative: str
    # Window layers in slots of their own (engine/window_slots.py): how many, one token's bytes in them; 0 = none
    window_slots: int = 0
    window_bytes_per_token: int = 0

    @classmethod
    def of(cls, core: EngineCore) -> EngineInfo:
        from engine.quant.module import quantized_formats

        runner = core.runner
        return cls(model_config=core.model_config, max_context=core.max_context,
                   kv_slots=runner.kv_pool.num_slots, kv_dtype=core.config.kv_cache_dtype_name,
                   kv_bytes_per_token=runner.kv_bytes_per_token, max_running_requests=core.config.max_running_requests,
                   decode_buckets=tuple(runner.graphs.buckets), compiled=runner.graphs.compiled,
                   packed_linear=bool(runner.model.packed), weights_tag=runner.weights_tag,
                   weight_bytes=runner.weight_bytes, file_bytes=runner.file_bytes,
                   quantized_formats=dict(quantized_formats(runner.model)),
                   pooling=core.pooling, hidden_size=core.model_config.hidden_size,
                   speculative=core.config.speculative if core.speculator is not None else "off",
                   **_window_info(core))


@dataclass(frozen=True)
class EngineStats:
    running: int  # sequences in the batch, prefilling or decoding
    waiting: int  # sequences queued for admission
    # prompt tokens still to prefill: waiting sequences in full, plus the rest of half-prefilled ones
    waiting_uncached_tokens: int
    kv_used_slots: int  # held by admitted requests (prefix-cache entries nobody holds are free: evicted on demand)
    prefix_cache_slots: int
    prefix_hit_tokens: int
    prefix_queried_tokens: int
    prefix_evicted_tokens: int
    prompt_tokens: int
    generation_tokens: int
    aborted: int
    retractions: int
    prefill_steps: int
    grammar_mask_seconds: float
    grammar_masked_rows: int
    cached_grammars: int
    steps_per_bucket: tuple[tuple[int, int], ...]  # (bucket, decode steps run in it); bucket 0: eager
    compile_seconds: tuple[tuple[int, float], ...]  # (bucket, seconds to make it ready)
    # (bucket, how it became ready: "eager", "loaded" from a saved step, "compiled" here, or by the "compile child")
    bucket_sources: tuple[tuple[int, str], ...]
    ready_buckets: tuple[int, ...]
    # speculative decoding (engine/speculative.py): draft tokens verified, accepted, and request-steps that verified
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0
    # (bucket, the planner's moving average of a decode step's seconds there): what it weighs drafts against
    spec_step_seconds: tuple[tuple[int, float], ...] = ()
    draft_ready_buckets: tuple[int, ...] | None = None  # a draft model's compiled decode buckets (None: no draft)
    kv_disk: DiskStats | None = None  # the prefix cache's disk tier (a copy), None when it is off
    # window layers' own slots: in use (admitted requests' windows and cached positions), and given back so far by
    # requests whose window moved on / taken from cached positions when they ran short
    window_used_slots: int = 0
    window_trimmed_tokens: int = 0
    window_reclaimed_tokens: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    @classmethod
    def of(cls, core: EngineCore) -> EngineStats:
        """Read on the engine thread, between steps."""
        sched, kvm, graphs, outputs = core.scheduler, core.kvm, core.runner.graphs, core.outputs
        stats, cache = sched.stats, kvm.stats
        spec = core.speculator.stats if core.speculator is not None else None
        to_prefill = (sum(r.fill_len for r in sched.waiting)
                      + sum(max(r.fill_len - r.kv_len, 0) for r in sched.prefilling))
        return cls(
            running=len(sched.running) + len(sched.prefilling), waiting=len(sched.waiting),
            waiting_uncached_tokens=to_prefill, kv_used_slots=kvm.held_slots(), prefix_cache_slots=kvm.cached_slots(),
            prefix_hit_tokens=cache.hit_tokens, prefix_queried_tokens=cache.queried_tokens,
            prefix_evicted_tokens=cache.evicted_tokens, prompt_tokens=stats.prompt_tokens,
            generation_tokens=stats.generation_tokens, aborted=stats.aborted, retractions=stats.retractions,
            prefill_steps=stats.prefill_steps, grammar_mask_seconds=outputs.mask_seconds,
            grammar_masked_rows=outputs.masked_rows, cached_grammars=core.grammars.cached(),
            steps_per_bucket=tuple(sorted(dict(graphs.steps_per_bucket).items())),
            compile_seconds=tuple(sorted(dict(graphs.compile_seconds).items())),
            bucket_sources=tuple(sorted(dict(graphs.sources).items())),
            ready_buckets=_ready(graphs),
            spec_proposed_tokens=spec.proposed if spec else 0, spec_accepted_tokens=spec.accepted if spec else 0,
            spec_verify_steps=spec.verify_steps if spec else 0,
            spec_step_seconds=tuple(sorted(core.speculator.planner.step_s.items())) if spec else (),
            draft_ready_buckets=None if core.drafter is None else _ready(core.drafter.runner.graphs),
            kv_disk=dataclasses.replace(kvm.disk.stats) if kvm.disk is not None else None,
            **({} if kvm.windows is None else dict(window_used_slots=kvm.windows.slots.used_size(),
                                                   window_trimmed_tokens=kvm.windows.trimmed_own,
                                                   window_reclaimed_tokens=kvm.windows.reclaimed)),
        )


def _window_info(core: EngineCore) -> dict[str, int]:
    ws = core.runner.kv_pool.window
    if ws is None:
        return {}
    return dict(window_slots=ws.num_slots, window_bytes_per_token=2 * len(ws.k) * ws.k[0][0].numel() * ws.k[0].itemsize)


def _ready(graphs: DecodeGraphs) -> tuple[int, ...]:
    """The compiled buckets ready to run (none when the graphs run eagerly)."""
    return tuple(graphs.ready_buckets) if graphs.compiled else ()
