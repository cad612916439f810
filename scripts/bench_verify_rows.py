"""What a speculative verify step costs: one decode step of 1, 2, 4 and 8 rows (a request's last token and its drafts
share a request row), eager, on the default SmolLM2 and on a random Llama-3.2-1B-shaped bf16 model (~2.5 GB written
to a temp dir; scripts/bench_kv_disk.py's). Prints the median ms per step and its ratio to one row: the price of
verifying k drafts in one pass (docs/speculative-decoding.md).
Usage: python scripts/bench_verify_rows.py
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kv_disk import llama1b  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.forward_batch import ForwardBatch  # noqa: E402
from engine.loader import open_checkpoint  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402


def step_ms(runner: ModelRunner, rows: int, repeats: int = 6) -> float:
    """Median ms of a decode step whose `rows` rows sit at consecutive positions of one request row."""
    row = runner.req_pool.allocate()
    assert row is not None
    times = []
    for _ in range(repeats):
        slots = runner.kv_pool.allocate(rows)
        assert slots is not None
        batch = ForwardBatch.decode(torch.full((rows,), 7), torch.arange(100, 100 + rows), torch.full((rows,), row),
                                    slots)
        t0 = time.perf_counter()
        runner.forward(batch)
        times.append(time.perf_counter() - t0)
        runner.kv_pool.free(slots)
    runner.req_pool.free(row)
    return statistics.median(times[1:]) * 1e3  # (the first call pays one-time costs)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, folder in (("smollm2", None), ("llama1b-bf16", str(llama1b(Path(tmp) / "l1b")))):
            cfg = EngineConfig(model=folder, max_total_tokens=4096, max_running_requests=8,
                               decode_buckets=(1, 2, 4, 8), disable_compile=True)
            runner = ModelRunner(cfg, open_checkpoint(folder))
            times = [(rows, step_ms(runner, rows)) for rows in (1, 2, 4, 8)]
            print(name, " ".join(f"{n} rows {ms:.1f} ms ({ms / times[0][1]:.2f}x)" for n, ms in times), flush=True)
            del runner


if __name__ == "__main__":
    main()
