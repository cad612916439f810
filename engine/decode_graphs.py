"""Compiled decode step per batch-size bucket: pad to the bucket, run its graph, slice back.

Static input buffers are allocated once at the largest bucket; bucket b runs on views `[:b]` of them, so
every call of one bucket sees identical shapes, strides and data pointers and never recompiles. Padded
rows point at request row 0 / KV slot 0 with sequence length 1 (see engine/pools.py).

Graphs are never frozen: the weights are module state passed to every bucket's graph (packed once for
ember::linear_bf16 in bf16, plain in fp32), so all buckets share one copy and each bucket's whole compiled step
can be saved (dynamo's `aot_compile`) and loaded on the next start. Freezing would fold a copy of the weights into
every bucket and bypass both the FX graph cache and the saved steps (docs/design.md §3).

The KV buffers' slot dimension (dim 0 of every k/v cache) is compiled symbolic: it only reaches the opaque
`ember::decode_attention` op (which writes the new K/V and gathers the pool), so the generated code is the same as
with a static size and one saved step runs on a pool of any size. The pool is sized from the memory free at start
(engine/model_runner.py size_kv_pool), so a static slot count would make every restart compile afresh.

With `background=True` the engine serves before every bucket is compiled: the largest saved step loads at once, the
other saved steps load in the background, the rest compile largest first, and each is swapped in as it becomes
ready. Until then a batch runs in the smallest ready bucket that holds it, or eagerly. Every path computes the same
tokens (tests/test_decode_graphs.py). Where the buckets compile: given `spawn_child` (the runner passes one when
there is a folder of saved steps), in a child process at the lowest CPU priority (engine/compile_child.py) whose
saved steps a thread here loads as each one is announced; a compile in this process would hold its GIL and both
cores, and serving barely moved (0.8 tok/s a client against 70-86). If the child cannot start, fails or dies, the
buckets it did not deliver compile in that thread, in this process.
"""
from __future__ import annotations

import bisect
import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from torch import nn

from engine.compile_child import NoRoomForChild
from engine.files import write_atomically
from engine.forward_batch import DECODE_INPUTS, ForwardBatch

if TYPE_CHECKING:
    from engine.compile_child import CompileChild

log = logging.getLogger("ember.compile")

# step(*DECODE_INPUTS, req_to_token, k_caches, v_caches) -> logits [B, V] (see DecodeStepModule)
DecodeStep = Callable[..., torch.Tensor]
EAGER = 0  # steps_per_bucket key of steps that ran the eager module because no fitting bucket was ready yet


class _Inputs:
    """The per-row inputs of one decode step, padded: rows past the real ones point at row 0 / slot 0."""

    def __init__(self, n: int) -> None:
        self.input_ids = torch.zeros(n, dtype=torch.int64)
        self.positions = torch.zeros(n, dtype=torch.int64)
        self.req_rows = torch.zeros(n, dtype=torch.int64)
        self.seq_lens = torch.ones(n, dtype=torch.int64)
        self.out_slots = torch.zeros(n, dtype=torch.int64)

    def pad_from(self, start: int, end: int) -> None:
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.req_rows[start:end] = 0
        self.seq_lens[start:end] = 1
        self.out_slots[start:end] = 0

    def view(self, bs: int) -> tuple[torch.Tensor, ...]:
        """The first `bs` rows, in DECODE_INPUTS order."""
        return tuple(getattr(self, name)[:bs] for name in DECODE_INPUTS)


class DecodeStepModule(nn.Module):
    """The pure decode step that torch.compile sees: weights are module state, everything else an input. A compiled
    graph takes tensors, not the ForwardBatch itself, so the batch's tensors come in DECODE_INPUTS order and the step
    rebuilds the batch the model reads."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, req_rows: torch.Tensor, out_slots: torch.Tensor,
                seq_lens: torch.Tensor, req_to_token: torch.Tensor, k_caches: list[torch.Tensor],
                v_caches: list[torch.Tensor]) -> torch.Tensor:
        batch = ForwardBatch.decode(input_ids, positions, req_rows, out_slots, seq_lens, req_to_token)
        return self.model(batch, k_caches, v_caches)


def mark_slots_dynamic(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
    """Compile the KV buffers' slot dimension symbolic (see the module docstring). Window rings (engine/pools.py) have
    a size fixed by the flags, but nothing is lost by marking them too: the dimension only reaches the custom op."""
    import torch._dynamo

    for t in (*k_caches, *v_caches):
        torch._dynamo.mark_dynamic(t, 0)  # no min/max: torch 2.13 asserts on a range with only one bound


class DecodeGraphs:
    def __init__(self, step: torch.nn.Module, buckets: tuple[int, ...], compile: bool, cpp_wrapper: bool = False,
                 artifact_dir: Path | None = None) -> None:
        """artifact_dir: where each bucket's whole compiled step is saved and loaded from on the next start. A warm
        inductor cache alone still re-traces the model with dynamo every start (~2-5 s per bucket); loading an
        artifact takes well under a second. The caller names the folder after everything the graphs depend on
        (ModelRunner._decode_artifact_dir)."""
        self.step, self.buckets, self.compiled = step, tuple(sorted(buckets)), compile
        self.cpp_wrapper = cpp_wrapper
        self.artifact_dir = artifact_dir if compile else None
        self.outcomes: dict[int, str] = {}  # bucket -> how it became ready, in words (the log's)
        self.sources: dict[int, str] = {}  # bucket -> "eager" | "loaded" | "compiled" | "compile child"
        self.inputs = _Inputs(self.buckets[-1])
        self.fns: dict[int, DecodeStep] = {}  # written by the compile thread, read by the engine thread
        self.compile_seconds: dict[int, float] = {}
        self.steps_per_bucket: dict[int, int] = dict.fromkeys((EAGER, *self.buckets), 0)
        self.compile_finished = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._child: CompileChild | None = None
        self._child_lock = threading.Lock()  # `stop` and the loader thread agree on whether a child may start

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def ready_buckets(self) -> list[int]:
        return sorted(self.fns)

    def bucket_for(self, batch: int) -> int:
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} exceeds the largest decode bucket {self.max_batch}")
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    def capture(self, req_to_token: torch.Tensor, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                on_bucket: Callable[[int, float], None] | None = None, background: bool = False,
                spawn_child: Callable[[list[int]], CompileChild] | None = None) -> None:
        """Make every bucket runnable, largest first (the largest sets the memory high-water mark early).

        background: return once the largest saved step is loaded; load the other saved steps and compile the rest in
        the background (`compile_finished` is set when the last bucket is in). spawn_child(buckets): a child process
        that compiles those buckets into `artifact_dir` (engine/compile_child.py); without one, or when it fails, they
        compile in a thread here."""
        if self.compiled:
            # Imported here, not at the top: dynamo alone takes ~1.7 s to import, which an eager run never needs.
            import torch._dynamo

            import kernels_fake  # noqa: F401  (fake kernels must exist before tracing ember:: ops)

            # Each bucket is its own graph of one code object: allow them all, plus slack.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(self.buckets) + 4)
            torch._dynamo.config.accumulated_recompile_limit = max(
                torch._dynamo.config.accumulated_recompile_limit, 4 * len(self.buckets) + 16
            )
            mark_slots_dynamic(k_caches, v_caches)
        order = sorted(self.buckets, reverse=True)
        pools = (req_to_token, k_caches, v_caches)
        if background and self.compiled:
            saved = [bs for bs in order if self._saved_path(bs) is not None]
            if saved:  # the largest saved step now: from here on every batch runs compiled, padded if need be
                self._make_ready(saved[0], pools, on_bucket)
            later, left = saved[1:], [bs for bs in order if bs not in saved]
            if later or left:
                if later:
                    log.info("serving now; saved decode buckets %s load in the background", later)
                if left:  # (where: a child process if there is memory for one, said once it starts; else a thread)
                    log.info("serving now; decode buckets %s compile in the background, largest first", left)
                self._thread = threading.Thread(target=self._finish, args=(later, left, spawn_child, pools, on_bucket),
                                                name="ember-compile", daemon=True)
                self._thread.start()
                return
        else:
            for bs in order:
                self._make_ready(bs, pools, on_bucket)
        self.compile_finished.set()

    def _finish(self, later: list[int], left: list[int], spawn_child: Callable[[list[int]], CompileChild] | None,
                pools: tuple, on_bucket: Callable[[int, float], None] | None) -> None:
        """The background part of a start: load the other saved steps (each ~0.6 s, so a warm restart answers /health
        seconds sooner), then compile the buckets without one."""
        try:
            for bs in later:
                if self._stop.is_set():
                    break
                self._make_ready(bs, pools, on_bucket)
        except Exception:  # the buckets still missing run in a larger ready bucket
            log.exception("loading saved decode buckets in the background failed")
        if self._stop.is_set() or not left:
            self.compile_finished.set()
        elif spawn_child is not None:
            self._compile_in_child(spawn_child, left, pools, on_bucket)
        else:
            log.info("decode buckets %s compile in a thread of this process", left)
            self._compile_all(left, pools, on_bucket)

    def stop(self, timeout: float | None = None) -> None:
        """Stop compiling (engine shutdown): a compile child is ended at once, a compile thread after its bucket."""
        with self._child_lock:
            self._stop.set()
            child = self._child
        if child is not None:
            child.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def child_pid(self) -> int | None:
        """The compile child's process id while it runs (for the server's info and its tests)."""
        child = self._child
        return child.pid if child is not None and child.proc.poll() is None else None

    def _compile_in_child(self, spawn_child: Callable[[list[int]], CompileChild], order: list[int], pools: tuple,
                          on_bucket: Callable[[int, float], None] | None) -> None:
        """Load each bucket the child announces; whatever it did not deliver compiles here (`_compile_all`)."""
        why = ""
        try:
            with self._child_lock:
                if self._stop.is_set():
                    self.compile_finished.set()
                    return
                child = self._child = spawn_child(order)
            log.info("compile child %d started for decode buckets %s", child.pid, order)
            for bs, child_secs in child.finished():
                if self._stop.is_set():
                    break
                if bs in order and bs not in self.fns:  # (a step it did not save compiles here, in this thread)
                    self._make_ready(bs, pools, on_bucket, child_secs if self._saved_path(bs) else 0.0)
                if all(b in self.fns for b in order):
                    break  # all in: its exit is no news (and stop() below ends it if it lingers)
            else:
                code = child.wait()
                if code != 0 and not self._stop.is_set():
                    why = f"it exited with status {code}"
            child.stop(timeout=10.0)  # closes its pipes
        except NoRoomForChild as exc:  # nor room for a compile here: these buckets run eagerly (same tokens)
            log.warning("decode buckets %s not compiled: %s; they run eagerly. `ember compile` with the same flags, "
                        "run while no server holds the memory, saves their steps for the next start", order, exc)
            self.compile_finished.set()
            return
        except Exception as exc:  # could not start it, or a broken pipe: the thread takes over
            why = f"{type(exc).__name__}: {exc}"
        if self._stop.is_set():
            self.compile_finished.set()
            return
        left = [bs for bs in order if bs not in self.fns]
        if left:
            log.warning("the compile child did not deliver decode buckets %s (%s); compiling them in this process",
                        left, why or "it exited without them")
        self._compile_all(left, pools, on_bucket)

    def _compile_all(self, order: list[int], pools: tuple, on_bucket: Callable[[int, float], None] | None) -> None:
        try:
            for bs in order:
                if self._stop.is_set():
                    return
                self._make_ready(bs, pools, on_bucket)
            log.info("all decode buckets ready: %s", self.ready_buckets)
        except Exception:  # serving goes on with the buckets that are ready (and eager steps for the rest)
            log.exception("compiling decode buckets in the background failed; "
                          "batches without a ready bucket run eagerly")
        finally:
            self.compile_finished.set()

    def _make_ready(self, bs: int, pools: tuple, on_bucket: Callable[[int, float], None] | None,
                    compiled_elsewhere: float = 0.0) -> None:
        """compiled_elsewhere: seconds a compile child spent on this bucket, whose saved step is now loaded."""
        t0 = time.perf_counter()
        # Private padded inputs: the compile thread must not touch the buffers `run` fills. The compiled step takes
        # its inputs as arguments, so it later runs on `self.inputs` views of the same shapes and strides.
        args = (*_Inputs(bs).view(bs), *pools)
        if not self.compiled:
            fn, outcome = self.step, "eager"
        else:
            import torch._inductor.config

            # size_asserts off: the wrapper otherwise re-checks every input's and every custom op output's shape and
            # stride on each call (~400 checks, ~0.25 ms of a batch-1 step); shapes are static per bucket and the
            # ops' fake kernels are tested against the real ones (tests/test_linear_op.py, test_attention_ops.py).
            with torch._inductor.config.patch(freezing=False, cpp_wrapper=self.cpp_wrapper, size_asserts=False):
                if self.artifact_dir is not None:
                    fn, outcome = self._precompiled(bs, args)
                else:
                    fn, outcome = torch.compile(self.step, dynamic=False, fullgraph=True), "compiled (no saved steps)"
                with torch.no_grad():
                    fn(*args)  # the first call compiles (plain torch.compile) and warms every path
        secs = time.perf_counter() - t0 + compiled_elsewhere
        source = "eager" if not self.compiled else "loaded" if outcome.startswith("loaded") else "compiled"
        if compiled_elsewhere:
            outcome = f"compiled by the compile child in {compiled_elsewhere:.1f} s, then {outcome}"
            source = "compile child"
        self.sources[bs] = source
        self.compile_seconds[bs] = secs
        self.outcomes[bs] = outcome
        self.fns[bs] = fn  # last: `run` may pick it up from now on
        if self.compiled:
            log.info("decode bucket %d [%d/%d] ready in %.1f s (%s)", bs, len(self.fns), len(self.buckets), secs,
                     outcome)
        if on_bucket is not None:
            on_bucket(bs, secs)

    def _saved_path(self, bs: int) -> Path | None:
        if self.artifact_dir is None:
            return None
        path = self.artifact_dir / f"bucket-{bs}.bin"
        return path if path.is_file() else None

    def _precompiled(self, bs: int, args: tuple) -> tuple[DecodeStep, str]:
        """Load bucket `bs`'s saved step, or compile it ahead of time and save it for the next start."""
        assert self.artifact_dir is not None
        import torch._dynamo

        torch._dynamo.config.enable_aot_compile = True
        path = self._saved_path(bs)
        if path is not None:
            try:
                with path.open("rb") as f:
                    fn = torch.compiler.load_compiled_function(f)
                fn.disable_guard_check()  # see below
                return functools.partial(fn, self.step), f"loaded {path}"
            except Exception as exc:  # another torch or CPU than the saver's: compile afresh
                log.warning("saved decode bucket %d did not load (%s: %s); compiling it", bs, type(exc).__name__, exc)
        fwd = torch.compile(type(self.step).forward, fullgraph=True, dynamic=False)
        with torch.no_grad():
            fn = fwd.aot_compile(((self.step, *args), {}))
        # Dynamo's guards re-check every input's shape, stride and dtype on each call (~1.5 % of a batch-1 step in
        # a py-spy profile); `run` always passes the same static buffers, the same pools and no_grad, so skip them.
        fn.disable_guard_check()
        path = self.artifact_dir / f"bucket-{bs}.bin"
        write_atomically(path, fn.save_compiled_function)
        return functools.partial(fn, self.step), f"compiled ahead of time, saved to {path}"

    def run(self, batch: ForwardBatch, req_to_token: torch.Tensor, k_caches: list[torch.Tensor],
            v_caches: list[torch.Tensor]) -> torch.Tensor:
        """Logits [B, V] for one decode batch of B real rows."""
        b = batch.num_rows
        bs = self.bucket_for(b)
        fns = self.fns
        if bs not in fns:  # still compiling: the smallest ready bucket that holds the batch, else eager
            bs = next((c for c in self.buckets if c >= b and c in fns), EAGER)
        x = self.inputs
        for name in DECODE_INPUTS:
            getattr(x, name)[:b] = getattr(batch, name)
        self.steps_per_bucket[bs] += 1
        with torch.no_grad():
            if bs == EAGER:
                return self.step(*x.view(b), req_to_token, k_caches, v_caches)
            x.pad_from(b, bs)
            logits = fns[bs](*x.view(bs), req_to_token, k_caches, v_caches)
        return logits[:b]
