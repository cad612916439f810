"""Microseconds per layer of `ember::decode_attention` at the shapes of the models Ember serves, and the KV bytes
per second that makes, on each ISA tier this CPU runs; with --prefill, `ember::prefill_attention` of one whole prompt
of each --context length next to the SDPA reference it replaced (GFLOP/s of the causal products).

Each shape gets one KV pool per layer (so a step's K/V come from memory, as in a model, not from the cache a single
layer would stay in), laid out as a server fills it: each request's prompt in consecutive slots, then its decoded
tokens interleaved with its batch mates'. The op runs once per layer and the median over `--reps` passes is printed.
Compare kernels by running this on two trees in turn (attention is KV-bandwidth and compute bound, and the
bandwidth of a shared machine drifts: alternate, do not compare across hours).

  python scripts/bench_attention.py                       # the default shapes, the active tier, 2 threads
  python scripts/bench_attention.py --isa avx2 --context 1024 4096 --threads 1
  python scripts/bench_attention.py --shapes smollm2 --batch 1 8 --rows 1 4 8 --context 384   # verify steps
  python scripts/bench_attention.py --prefill --context 256 512 2048 --dtype float32
  python scripts/bench_attention.py --against avx512 --rows 1 4 --reps 12   # two kernels in turn, same data
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from engine.ops.attention import reference_prefill_attention  # (the import registers the ember:: ops)
from engine.ops.native import active_isa, forced_isa

# name: (query heads, KV heads, head size, layers)
SHAPES = {"smollm2": (9, 3, 64, 30), "llama1b": (32, 8, 64, 16), "llama3b": (24, 8, 128, 28),
          "llama8b": (32, 8, 128, 32)}


def pool(batch: int, context: int, kv_heads: int, dim: int, layers: int,
         dtype: torch.dtype) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """K/V caches per layer and the request-to-token table of `batch` requests of `context` positions."""
    decoded = min(64, context - 1)
    runs, nxt = [], 1  # slot 0 is the padding slot
    for _ in range(batch):
        runs.append(list(range(nxt, nxt + context - decoded)))
        nxt += context - decoded
    for _ in range(decoded):
        for r in runs:
            r.append(nxt)
            nxt += 1
    table = torch.zeros(batch + 1, context + 8, dtype=torch.int32)
    for b, r in enumerate(runs):
        table[b + 1, :context] = torch.tensor(r, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn(nxt, kv_heads, dim, generator=gen).to(dtype),
               torch.randn(nxt, kv_heads, dim, generator=gen).to(dtype)) for _ in range(layers)]
    return caches, table


def bench(name: str, batch: int, context: int, reps: int, dtype: torch.dtype, rows_each: int = 1,
          against: str | None = None) -> tuple[float, float, float | None]:
    """rows_each: rows per request at consecutive positions ending at `context` (a verify step's last token and
    drafts, engine/speculative.py), all on the request's row of the table. against: a tier (or "avx512bf16:dot")
    whose kernel runs in turn with the active one, each pass over the layers in alternating order, on the same
    data: (seconds a layer, KV bytes a second, the other's seconds a layer or None)."""
    heads, kv_heads, dim, layers = SHAPES[name]
    caches, table = pool(batch, context, kv_heads, dim, layers, dtype)
    gen = torch.Generator().manual_seed(1)
    n = batch * rows_each
    q, k, v = (torch.randn(n, h, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    rows = torch.arange(1, batch + 1).repeat_interleave(rows_each)
    lens = (context - rows_each + 1 + torch.arange(rows_each)).repeat(batch)
    out_slots = table[rows, lens - 1].long()
    ops = [torch.ops.ember.decode_attention]
    if against is not None:
        ops.append(lambda *args: torch.ops.ember.decode_attention_isa(*args, against))
    times: list[list[float]] = [[] for _ in ops]
    for r in range(reps):
        for i in (range(len(ops)) if r % 2 == 0 else reversed(range(len(ops)))):
            t0 = time.perf_counter()
            for kc, vc in caches:
                ops[i](q, k, v, kc, vc, out_slots, table, rows, lens, dim ** -0.5)
            times[i].append((time.perf_counter() - t0) / layers)
    sec = statistics.median(times[0])
    other = statistics.median(times[1]) if against is not None else None
    return sec, batch * context * kv_heads * dim * 2 * dtype.itemsize / sec, other


def bench_prefill(name: str, tokens: int, reps: int, dtype: torch.dtype) -> tuple[float, float, float]:
    """Seconds per layer of the C++ op and of SDPA on one `tokens`-long prompt, and the FLOPs of one layer."""
    heads, kv_heads, dim, _ = SHAPES[name]
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(tokens, h, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    kc, vc = (torch.zeros(tokens + 1, kv_heads, dim, dtype=dtype) for _ in range(2))
    table = torch.zeros(2, tokens, dtype=torch.int32)
    table[1] = torch.arange(1, tokens + 1, dtype=torch.int32)
    meta = (torch.arange(1, tokens + 1), table, torch.tensor([1]), torch.tensor([0]), torch.tensor([tokens]))
    ops = (torch.ops.ember.prefill_attention, reference_prefill_attention)
    best = []
    for op in ops:
        op(q, k, v, kc, vc, *meta, dim ** -0.5)  # warm
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            op(q, k, v, kc, vc, *meta, dim ** -0.5)
            times.append(time.perf_counter() - t0)
        best.append(statistics.median(times))
    return best[0], best[1], 2.0 * tokens * tokens * dim * heads  # QK and PV over the causal half


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--rows", type=int, nargs="+", default=[1], help="rows per request (verify steps: 1 + drafts)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--isa", default=None, help="force a lower tier (avx2, avx512, scalar); default: the active one")
    ap.add_argument("--against", default=None,
                    help="a tier (or avx512bf16:dot) run in turn with the active one on the same data, for a ratio")
    ap.add_argument("--prefill", action="store_true", help="time prefill attention of one prompt per --context")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    with forced_isa(a.isa) if a.isa else contextlib.nullcontext():
        print(f"tier {active_isa()}, {a.threads} threads, {a.dtype} KV")
        if a.prefill:
            if active_isa() == "scalar":
                raise SystemExit("ember::prefill_attention has no scalar kernel (SDPA runs on that tier)")
            print("| shape | prompt | ember us / layer (GFLOP/s) | SDPA us / layer (GFLOP/s) | speedup |")
            print("| --- | --- | --- | --- | --- |")
            for name in a.shapes:
                for tokens in a.context:
                    ours, sdpa, flop = bench_prefill(name, tokens, a.reps, dtype)
                    print(f"| {name} | {tokens} | {ours * 1e6:.0f} ({flop / ours / 1e9:.0f}) | {sdpa * 1e6:.0f} "
                          f"({flop / sdpa / 1e9:.0f}) | {sdpa / ours:.2f}x |", flush=True)
            return
        extra = f" {a.against} us / layer | active / {a.against} |" if a.against else ""
        print("| shape | batch | rows each | context | us / layer | KV GB/s |" + extra)
        print("| --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if a.against else ""))
        for name in a.shapes:
            for batch in a.batch:
                for rows_each in a.rows:
                    for context in a.context:
                        sec, rate, other = bench(name, batch, context, a.reps, dtype, rows_each, a.against)
                        cols = f" {other * 1e6:.1f} | {sec / other:.2f}x |" if other is not None else ""
                        print(f"| {name} | {batch} | {rows_each} | {context} | {sec * 1e6:.1f} | {rate / 1e9:.1f} |"
                              + cols, flush=True)


if __name__ == "__main__":
    main()
