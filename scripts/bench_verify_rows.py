"""What a speculative verify step costs: one decode step in which each of R requests has r rows (its last token and
r - 1 drafts at consecutive positions of its request row, as engine/speculative.py lays them out), against the same
step with one row each. Prints the median ms per step and its ratio to r = 1: the price of verifying r - 1 drafts in
one pass (docs/speculative-decoding.md).

    .venv/bin/python scripts/bench_verify_rows.py [MODEL] [--requests 1] [--rows 1 2 4 8]
        [--context 384] [--threads 2] [--eager] [--no-cpp-wrapper] [--llama1b]

MODEL: a GGUF file or HF folder (default: the embedded SmolLM2). Each request holds --context tokens of random
prompt (prefilled once), so the attention reads a realistic context. The steps run the compiled decode bucket of
R * r rows (compiled at start) unless --eager. --llama1b: a random Llama-3.2-1B-shaped bf16 model instead (~2.5 GB
written to a temp dir; scripts/bench_kv_disk.py's).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from engine.omp_env import set_thread_env

set_thread_env()  # before torch: the OpenMP spin the server runs with (OMP_WAIT_POLICY / GOMP_SPINCOUNT win)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kv_disk import llama1b  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.forward_batch import ForwardBatch, PrefillChunk  # noqa: E402
from engine.loader import open_checkpoint  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402


def step_ms(runner: ModelRunner, req_rows: list[int], context: int, r: int, repeats: int = 12) -> float:
    """Median ms of a decode step of r rows per request, at positions context.. of each request row."""
    n = len(req_rows)
    rows = torch.tensor(req_rows).repeat_interleave(r)
    positions = (context + torch.arange(r)).repeat(n)
    times = []
    for _ in range(repeats):
        slots = runner.kv_pool.allocate(n * r)
        assert slots is not None
        t0 = time.perf_counter()
        runner.forward(ForwardBatch.decode(torch.full((n * r,), 7), positions, rows, slots))
        times.append(time.perf_counter() - t0)
        runner.kv_pool.free(slots)
    return statistics.median(times[2:]) * 1e3  # (the first calls pay one-time costs)


def measure(model: str | None, args: argparse.Namespace) -> None:
    buckets = tuple(sorted({args.requests * r for r in args.rows}))
    cfg = EngineConfig(model=model, max_total_tokens=args.requests * (args.context + 64) + 1024,
                       max_running_requests=max(buckets), decode_buckets=buckets, disable_compile=args.eager,
                       num_threads=args.threads, background_compile=False,
                       cpp_wrapper=args.cpp_wrapper).resolved()
    runner = ModelRunner(cfg, open_checkpoint(model))
    gen = torch.Generator().manual_seed(0)
    chunks, req_rows = [], []
    for _ in range(args.requests):
        row, slots = runner.req_pool.allocate(), runner.kv_pool.allocate(args.context)
        assert row is not None and slots is not None
        req_rows.append(row)
        prompt = torch.randint(0, runner.model_config.vocab_size, (args.context,), generator=gen).tolist()
        chunks.append(PrefillChunk(row, 0, prompt, slots))
    runner.forward(ForwardBatch.prefill(chunks))
    times = [(r, step_ms(runner, req_rows, args.context, r)) for r in args.rows]
    mode = "eager" if args.eager else "compiled"
    print(f"{model or 'smollm2'} ({mode}, {args.requests} request(s), context {args.context}): " +
          ", ".join(f"{r} rows each {ms:.2f} ms ({ms / times[0][1]:.2f}x)" for r, ms in times), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--rows", nargs="*", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--context", type=int, default=384)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--cpp-wrapper", action=argparse.BooleanOptionalAction, default=True,
                    help="inductor's C++ wrapper, as `ember serve` compiles (default: %(default)s)")
    ap.add_argument("--llama1b", action="store_true")
    args = ap.parse_args()
    if args.llama1b:
        with tempfile.TemporaryDirectory() as tmp:
            measure(str(llama1b(Path(tmp) / "l1b")), args)
    else:
        measure(args.model, args)


if __name__ == "__main__":
    main()
