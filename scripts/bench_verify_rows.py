"""What a speculative verify step costs: one decode step in which each of R requests has r rows (its last token and
r - 1 drafts at consecutive positions of its request row, as engine/speculative.py lays them out), against the same
step with one row each. Prints the median ms per step and its ratio to r = 1: the price of verifying r - 1 drafts in
one pass (docs/speculative-decoding.md).

    .venv/bin/python scripts/bench_verify_rows.py [MODEL] [--requests 1] [--rows 1 2 4 8]
        [--context 384] [--threads 2] [--eager] [--no-cpp-wrapper] [--llama1b] [--ceiling PROMPT MAX_TOKENS]

MODEL: a GGUF file or HF folder (default: the embedded SmolLM2). Each request holds --context tokens of random
prompt (prefilled once), so the attention reads a realistic context. The steps run the compiled decode bucket of
R * r rows (compiled at start) unless --eager. --llama1b: a random Llama-3.2-1B-shaped bf16 model instead (~2.5 GB
written to a temp dir; scripts/bench_kv_disk.py's).
--ceiling PROMPT MAX_TOKENS: also time one prefill of PROMPT tokens and print the most speculation could gain for
R clients each sending such requests, if every draft were accepted: R prefills plus MAX_TOKENS steps of R rows,
against R prefills plus MAX_TOKENS / r steps of R * r rows (prefills cost the same in both modes, and on a
compute-bound CPU running them beside decode saves nothing; docs/speculative-decoding.md).
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


def one_step(runner: ModelRunner, req_rows: list[int], context: int, r: int) -> float:
    """Seconds of one decode step of r rows per request, at positions context.. of each request row."""
    n = len(req_rows)
    rows = torch.tensor(req_rows).repeat_interleave(r)
    positions = (context + torch.arange(r)).repeat(n)
    slots = runner.kv_pool.allocate(n * r)
    assert slots is not None
    t0 = time.perf_counter()
    runner.forward(ForwardBatch.decode(torch.full((n * r,), 7), positions, rows, slots))
    took = time.perf_counter() - t0
    runner.kv_pool.free(slots)
    return took


def step_ms(runner: ModelRunner, req_rows: list[int], context: int, rows: list[int], prompt_len: int,
            repeats: int = 12) -> tuple[list[tuple[int, float]], float]:
    """(r, median ms of a step of r rows per request) for each r, and the median ms of one prefill of prompt_len
    tokens (0: none), taken in turn each round, so that a shared host's drift moves them all alike (the first two
    rounds pay one-time costs and are left out)."""
    times: dict[int, list[float]] = {r: [] for r in rows}
    prefills: list[float] = []
    gen = torch.Generator().manual_seed(1)
    for _ in range(repeats + 2):
        for r in rows:
            times[r].append(one_step(runner, req_rows, context, r))
        if prompt_len:
            prefills.append(one_prefill(runner, prompt_len, gen))
    pre = statistics.median(prefills[2:]) * 1e3 if prompt_len else 0.0
    return [(r, statistics.median(times[r][2:]) * 1e3) for r in rows], pre


def one_prefill(runner: ModelRunner, tokens: int, gen: torch.Generator) -> float:
    """Seconds of one prefill of `tokens` random tokens on a fresh request row (given back after)."""
    row, slots = runner.req_pool.allocate(), runner.kv_pool.allocate(tokens)
    assert row is not None and slots is not None
    prompt = torch.randint(0, runner.model_config.vocab_size, (tokens,), generator=gen).tolist()
    t0 = time.perf_counter()
    runner.forward(ForwardBatch.prefill([PrefillChunk(row, 0, prompt, slots)]))
    took = time.perf_counter() - t0
    runner.kv_pool.free(slots)
    runner.req_pool.free(row)
    return took


def print_ceiling(requests: int, prompt: int, max_tokens: int, pre_ms: float, times: list[tuple[int, float]]) -> None:
    """The bound --ceiling describes, for each r of the measured rows (r = 1 is speculation off)."""
    base = dict(times)[1]
    off = requests * pre_ms + max_tokens * base
    parts = []
    for r, ms in times:
        if r == 1:
            continue
        decode = -(-max_tokens // r) * ms
        ratio, decode_ratio = off / (requests * pre_ms + decode), max_tokens * base / decode
        parts.append(f"{r} rows {ratio:.2f}x (decode alone {decode_ratio:.2f}x)")
    print(f"ceiling, {requests} clients, {prompt}-token prompts ({pre_ms:.1f} ms a prefill), {max_tokens} tokens, "
          "every draft accepted: " + ", ".join(parts), flush=True)


def measure(model: str | None, args: argparse.Namespace) -> None:
    buckets = tuple(sorted({args.requests * r for r in args.rows}))
    prompt_len = args.ceiling[0] if args.ceiling else 0
    # (one request row more than the requests: the --ceiling prefills')
    cfg = EngineConfig(model=model, max_total_tokens=args.requests * (args.context + 64) + prompt_len + 1024,
                       max_running_requests=max(max(buckets), args.requests + 1),
                       decode_buckets=buckets, disable_compile=args.eager,
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
    times, pre_ms = step_ms(runner, req_rows, args.context, args.rows, prompt_len)
    mode = "eager" if args.eager else "compiled"
    print(f"{model or 'smollm2'} ({mode}, {args.requests} request(s), context {args.context}): " +
          ", ".join(f"{r} rows each {ms:.2f} ms ({ms / times[0][1]:.2f}x)" for r, ms in times), flush=True)
    if args.ceiling:
        print_ceiling(args.requests, prompt_len, args.ceiling[1], pre_ms, times)


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
    ap.add_argument("--ceiling", nargs=2, type=int, metavar=("PROMPT", "MAX_TOKENS"), default=None)
    args = ap.parse_args()
    if args.ceiling and 1 not in args.rows:
        ap.error("--ceiling needs --rows to include 1 (speculation off)")
    if args.llama1b:
        with tempfile.TemporaryDirectory() as tmp:
            measure(str(llama1b(Path(tmp) / "l1b")), args)
    else:
        measure(args.model, args)


if __name__ == "__main__":
    main()
