"""Milliseconds of one decode step of one bucket (the runner's path, no scheduler), the weight bandwidth it reaches
against the machine's read bandwidth, and a torch.profiler breakdown.

    .venv/bin/python scripts/profile_decode.py [MODEL] [--batch 1] [--threads 2]
        [--eager] [--context 128] [--steps 20] [--compile-cache-dir DIR] [--no-cpp-wrapper] [--shapes]

MODEL: a GGUF file or HF folder (default: the embedded model). Random prompts of --context tokens are prefilled,
then --steps decode steps timed (every step rewrites the same slots: fine for timing), then 10 profiled.
"Weight GB/s" is the bytes of the weights in memory but the input embedding (read one row a token; a tied model
reads it whole as its head anyway) over the median step time.
"""
from __future__ import annotations

import argparse
import statistics
import time

from engine.omp_env import set_thread_env

set_thread_env()  # before torch: the OpenMP spin the server runs with (OMP_WAIT_POLICY / GOMP_SPINCOUNT win)

import torch
from torch.profiler import profile

from engine.config import EngineConfig
from engine.forward_batch import ForwardBatch, PrefillChunk
from engine.loader import resolve_model_path
from engine.loader.prepared import PreparedModel, open_cached
from engine.model_runner import ModelRunner
from engine.quant.module import QuantizedWeight


def step_weight_bytes(runner: ModelRunner) -> int:
    model, total = runner.model, runner.weight_bytes
    if model.lm_head is not None:  # untied: the input embedding is read one row per token
        e = model.embed_tokens
        total -= e.nbytes() if isinstance(e, QuantizedWeight) else e.numel() * e.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--eager", action="store_true", help="no torch.compile of the decode step")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--compile-cache-dir", default=None)
    ap.add_argument("--cpp-wrapper", action=argparse.BooleanOptionalAction, default=True,
                    help="inductor's C++ wrapper, as `ember serve` compiles (default: %(default)s)")
    ap.add_argument("--rows", type=int, default=15, help="rows of the profiler table")
    ap.add_argument("--shapes", action="store_true", help="the profiler table by op and input shapes")
    a = ap.parse_args()
    bs = a.batch
    cfg = EngineConfig(model=a.model, max_total_tokens=bs * (a.context + 64), max_running_requests=bs,
                       decode_buckets=(bs,), disable_compile=a.eager, num_threads=a.threads,
                       compile_cache_dir=a.compile_cache_dir, background_compile=False,
                       cpp_wrapper=a.cpp_wrapper).resolved()
    prepared = (PreparedModel(a.compile_cache_dir, resolve_model_path(a.model))
                if a.compile_cache_dir and a.model else None)
    runner = ModelRunner(cfg, open_cached(a.model, prepared) if a.model else open_cached(None, None), None, prepared)
    vocab = runner.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows, chunks = [], []
    for _ in range(bs):
        row, slots = runner.req_pool.allocate(), runner.kv_pool.allocate(a.context)
        assert row is not None and slots is not None
        rows.append(row)
        chunks.append(PrefillChunk(row, 0, torch.randint(0, vocab, (a.context,), generator=gen).tolist(), slots))
    tokens = runner.forward(ForwardBatch.prefill(chunks)).argmax(-1)
    rows_t = torch.tensor(rows)
    out_slots = runner.kv_pool.allocate(bs)
    assert out_slots is not None

    def step(i: int) -> float:
        t0 = time.perf_counter()
        runner.forward(ForwardBatch.decode(tokens, torch.full((bs,), a.context + i), rows_t, out_slots))
        return time.perf_counter() - t0

    for i in range(5):
        step(i)
    times = [step(i) for i in range(a.steps)]
    med = statistics.median(times)
    buf = torch.ones(2**30, dtype=torch.uint8)
    bw = max(float(torch.ops.ember.read_bandwidth(buf, 4)) for _ in range(3))
    del buf
    wbytes = step_weight_bytes(runner)
    print(f"batch {bs}, {'eager' if a.eager else 'compiled'}, threads {torch.get_num_threads()}: step median "
          f"{med * 1e3:.2f} ms (min {min(times) * 1e3:.2f}), {bs / med:.1f} tok/s; weights {wbytes / 2**20:.0f} MiB "
          f"-> {wbytes / med / 1e9:.1f} GB/s, read bandwidth {bw:.1f} GB/s ({wbytes / med / 1e9 / bw:.0%})")
    with profile(record_shapes=a.shapes) as prof:
        for i in range(10):
            step(i)
    print(prof.key_averages(group_by_input_shape=a.shapes).table(sort_by="self_cpu_time_total", row_limit=a.rows))


if __name__ == "__main__":
    main()
