"""Seconds of one prefill forward (the runner's eager prefill path, no scheduler) and a torch.profiler breakdown.

    .venv/bin/python scripts/profile_prefill.py MODEL [--tokens 128] [--threads 2]
        [--compile-cache-dir DIR] [--repeats 3]

MODEL: a GGUF file or HF folder (with --compile-cache-dir, its prepared copy is reused). Random prompt ids; each
repeat prefills the same prompt into fresh slots. Prints the median seconds and tokens/s, then the ops' self time
of one more prefill, and the minor page faults a prefill took (fresh activation pages).
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

from engine.omp_env import set_thread_env

set_thread_env()  # before torch: the OpenMP spin the server runs with (OMP_WAIT_POLICY / GOMP_SPINCOUNT win)

import torch
from torch.profiler import profile

from engine.config import EngineConfig
from engine.forward_batch import ForwardBatch, PrefillChunk
from engine.loader.prepared import PreparedModel, open_cached
from engine.loader import resolve_model_path
from engine.model_runner import ModelRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile-cache-dir", default=None)
    a = ap.parse_args()
    cfg = EngineConfig(model=a.model, max_total_tokens=(a.repeats + 2) * a.tokens, max_running_requests=1,
                       decode_buckets=(1,), disable_compile=True, num_threads=a.threads,
                       compile_cache_dir=a.compile_cache_dir, chunked_prefill_size=max(512, a.tokens)).resolved()
    prepared = PreparedModel(a.compile_cache_dir, resolve_model_path(a.model)) if a.compile_cache_dir else None
    runner = ModelRunner(cfg, open_cached(a.model, prepared), None, prepared)
    ids = torch.randint(0, runner.model_config.vocab_size, (a.tokens,), generator=torch.Generator().manual_seed(0))
    row = runner.req_pool.allocate()
    assert row is not None

    def prefill() -> float:
        slots = runner.kv_pool.allocate(a.tokens)
        assert slots is not None
        t0 = time.perf_counter()
        runner.forward(ForwardBatch.prefill([PrefillChunk(row, 0, ids.tolist(), slots)]))
        seconds = time.perf_counter() - t0
        runner.kv_pool.free(slots)
        return seconds

    prefill()  # warm-up: first-call allocations, oneDNN primitive creation
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = [prefill() for _ in range(a.repeats)]
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / a.repeats
    med = statistics.median(times)
    print(f"{a.tokens} tokens: median {med * 1e3:.0f} ms ({a.tokens / med:.0f} tok/s), each "
          + ", ".join(f"{t * 1e3:.0f}" for t in times) + f" ms; threads {torch.get_num_threads()}; "
          f"{faults:.0f} minor page faults a prefill")
    with profile() as prof:
        prefill()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
