"""Decode tokens/s and a torch.profiler breakdown of one decode bucket of the default model (no scheduler).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/profile_decode.py THREADS BATCH c|e [w]
      c = compiled (inductor freezing), e = eager, w = also --cpp-wrapper; NOPREPACK=1 turns oneDNN weight
      prepacking off to measure what it buys. 128-token random prompts, 20 timed steps, then 10 profiled.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch._inductor.config as inductor_config
from torch.profiler import profile

from engine.config import EngineConfig
from engine.loader import open_checkpoint
from engine.forward_batch import ForwardBatch, PrefillChunk
from engine.model_runner import ModelRunner


def main() -> None:
    threads, bs, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if os.environ.get("NOPREPACK"):
        inductor_config.cpp.weight_prepack = False
    cfg = EngineConfig(dtype="bfloat16", max_total_tokens=bs * 300, max_running_requests=bs, decode_buckets=(bs,),
                       disable_compile=mode != "c", num_threads=threads, cpp_wrapper=len(sys.argv) > 4)
    runner = ModelRunner(cfg, open_checkpoint(None))
    gen = torch.Generator().manual_seed(0)
    rows, chunks = [], []
    for _ in range(bs):
        row, slots = runner.req_pool.allocate(), runner.kv_pool.allocate(128)
        assert row is not None and slots is not None
        rows.append(row)
        chunks.append(PrefillChunk(row, 0, torch.randint(0, 49152, (128,), generator=gen).tolist(), slots))
    tokens = runner.forward(ForwardBatch.prefill(chunks)).argmax(-1)
    rows_t = torch.tensor(rows)
    out_slots = runner.kv_pool.allocate(bs)  # every step rewrites the same slots: fine for timing
    assert out_slots is not None

    def step(i: int) -> None:
        runner.forward(ForwardBatch.decode(tokens, torch.full((bs,), 128 + i), rows_t, out_slots))

    for i in range(5):
        step(i)
    t0 = time.perf_counter()
    for i in range(20):
        step(i)
    print(f"tok/s {bs * 20 / (time.perf_counter() - t0):.1f}")
    with profile() as prof:
        for i in range(10):
            step(i)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
