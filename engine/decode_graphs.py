"""Compiled decode step per batch-size bucket: pad to the bucket, run its graph, slice back.

Static input buffers are allocated once at the largest bucket; bucket b runs on views `[:b]` of them, so
every call of one bucket sees identical shapes, strides and data pointers and never recompiles. Padded
rows point at request row 0 / KV slot 0 with sequence length 1 (see engine/pools.py).
"""
from __future__ import annotations

import bisect
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch._dynamo
import torch._dynamo.utils
import torch._inductor.config

import kernels_fake  # noqa: F401  (fake kernels must exist before tracing ember:: ops)
from engine.files import write_atomically

log = logging.getLogger("ember.compile")

# step(input_ids, positions, req_rows, seq_lens, out_slots, req_to_token, k_caches, v_caches) -> logits [B, V]
DecodeStep = Callable[..., torch.Tensor]


class DecodeGraphs:
    def __init__(self, step: torch.nn.Module, buckets: tuple[int, ...], compile: bool, cpp_wrapper: bool = False,
                 freeze: bool = True, artifact_dir: Path | None = None) -> None:
        """freeze: let inductor fold the weights into each bucket as constants (oneDNN prepacks plain linears).
        Off for packed ember::linear_bf16 weights: they are packed already and all buckets share one copy.

        artifact_dir (unfrozen graphs only): where each bucket's whole compiled step is saved (dynamo's
        `aot_compile`) and loaded from on the next start. A warm inductor cache alone still re-traces the model
        with dynamo every start (~2-5 s per bucket); loading an artifact takes well under a second. The caller
        names the folder after everything the graphs depend on (ModelRunner._decode_artifact_dir)."""
        self.step, self.buckets, self.compiled = step, tuple(sorted(buckets)), compile
        self.cpp_wrapper, self.freeze = cpp_wrapper, freeze
        self.artifact_dir = artifact_dir if compile and not freeze else None
        self.outcomes: dict[int, str] = {}
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64)
        self.positions = torch.zeros(n, dtype=torch.int64)
        self.req_rows = torch.zeros(n, dtype=torch.int64)
        self.seq_lens = torch.ones(n, dtype=torch.int64)
        self.out_slots = torch.zeros(n, dtype=torch.int64)
        self.fns: dict[int, DecodeStep] = {}
        self.compile_seconds: dict[int, float] = {}
        self.steps_per_bucket: dict[int, int] = dict.fromkeys(self.buckets, 0)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, batch: int) -> int:
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} exceeds the largest decode bucket {self.max_batch}")
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    def capture(self, req_to_token: torch.Tensor, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                on_bucket: Callable[[int, float], None] | None = None) -> None:
        """Compile every bucket now, largest first (the largest sets the memory high-water mark early)."""
        # Each bucket is its own graph of one code object: allow them all, plus slack.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(self.buckets) + 4)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 4 * len(self.buckets) + 16
        )
        order = sorted(self.buckets, reverse=True)
        cache = torch._dynamo.utils.counters["inductor"]
        for i, bs in enumerate(order, 1):
            before = {k: cache[f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")}
            t0 = time.perf_counter()
            args = self._args(bs, req_to_token, k_caches, v_caches)
            # size_asserts off: the wrapper otherwise re-checks every input's and every custom op output's shape and
            # stride on each call (~400 checks, ~0.25 ms of a batch-1 step); shapes are static per bucket and the
            # ops' fake kernels are tested against the real ones (tests/test_linear_op.py, test_attention_ops.py).
            with torch._inductor.config.patch(freezing=self.freeze, cpp_wrapper=self.cpp_wrapper, size_asserts=False):
                if self.artifact_dir is not None:
                    self.fns[bs], outcome = self._precompiled(bs, args)
                else:
                    # Compilation happens at this first call. Freezing turns the weights into constants so oneDNN
                    # can prepack them (DESIGN.md §4); it must be set through inductor's config, as here:
                    # torch.compile(options=...) ignores it.
                    self.fns[bs] = torch.compile(self.step, dynamic=False, fullgraph=True) if self.compiled else self.step
                    self._run_padding_only(bs, args)
                    # Frozen graphs store oneDNN-packed weights, which the FX graph cache cannot pickle: "bypass"
                    # (only inductor's C++ kernel cache is reused across restarts).
                    outcome = "fx graph cache " + (
                        ",".join(k for k, n in before.items() if cache[f"fxgraph_cache_{k}"] > n) or "none")
            secs = time.perf_counter() - t0
            self.compile_seconds[bs] = secs
            self.outcomes[bs] = outcome
            if self.compiled:
                log.info("decode bucket %d [%d/%d] ready in %.1f s (%s)", bs, i, len(order), secs, outcome)
            if on_bucket is not None:
                on_bucket(bs, secs)

    def _precompiled(self, bs: int, args: tuple) -> tuple[DecodeStep, str]:
        """Load bucket `bs`'s saved step, or compile it ahead of time and save it for the next start."""
        assert self.artifact_dir is not None
        torch._dynamo.config.enable_aot_compile = True
        path = self.artifact_dir / f"bucket-{bs}.bin"
        if path.is_file():
            try:
                with path.open("rb") as f:
                    fn = torch.compiler.load_compiled_function(f)
                fn.disable_guard_check()  # see below
                bound = functools.partial(fn, self.step)
                self._run_padding_only(bs, args, bound)
                return bound, f"loaded {path}"
            except Exception as exc:  # another torch or CPU than the saver's: compile afresh
                log.warning("saved decode bucket %d did not load (%s: %s); compiling it", bs, type(exc).__name__, exc)
        fwd = torch.compile(type(self.step).forward, fullgraph=True, dynamic=False)
        with torch.no_grad():
            fn = fwd.aot_compile(((self.step, *args), {}))
        # Dynamo's guards re-check every input's shape, stride and dtype on each call (~1.5 % of a batch-1 step in
        # a py-spy profile); `run` always passes the same static buffers, the same pools and no_grad, so skip them.
        fn.disable_guard_check()
        write_atomically(path, fn.save_compiled_function)
        bound = functools.partial(fn, self.step)
        self._run_padding_only(bs, args, bound)
        return bound, f"compiled ahead of time, saved to {path}"

    def _args(self, bs: int, req_to_token: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor]) -> tuple:
        self._pad_from(0, bs)
        return (self.input_ids[:bs], self.positions[:bs], self.req_rows[:bs], self.seq_lens[:bs],
                self.out_slots[:bs], req_to_token, k, v)

    def _run_padding_only(self, bs: int, args: tuple, fn: DecodeStep | None = None) -> None:
        with torch.no_grad():
            (fn or self.fns[bs])(*args)

    def _pad_from(self, start: int, end: int) -> None:
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.req_rows[start:end] = 0
        self.seq_lens[start:end] = 1
        self.out_slots[start:end] = 0

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, req_rows: torch.Tensor, out_slots: torch.Tensor,
            req_to_token: torch.Tensor, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> torch.Tensor:
        """Logits [B, V] for one decode step of B real rows."""
        b = int(input_ids.numel())
        bs = self.bucket_for(b)
        if bs not in self.fns:
            raise RuntimeError(f"decode bucket {bs} was never captured")
        self.input_ids[:b] = input_ids
        self.positions[:b] = positions
        self.req_rows[:b] = req_rows
        self.seq_lens[:b] = positions + 1
        self.out_slots[:b] = out_slots
        self._pad_from(b, bs)
        self.steps_per_bucket[bs] += 1
        with torch.no_grad():
            logits = self.fns[bs](self.input_ids[:bs], self.positions[:bs], self.req_rows[:bs], self.seq_lens[:bs],
                                  self.out_slots[:bs], req_to_token, k_caches, v_caches)
        return logits[:b]
