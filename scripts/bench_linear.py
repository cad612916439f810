"""Benchmark ember::linear_gguf (GGUF block bytes, int8 activations) against the machine's read bandwidth and
against ember::linear_q on the same weights (gguf_repack.repack + format.pack), on Llama-3.2-1B shapes (--model
smollm2: SmolLM2-135M's).

Per type, kernel variant and row count: the linears of `--layers` distinct layers run in model order, as the model
calls them (q|k|v, o, gate|up, down: shards of one type stacked into one weight), each call timed on its own, on
2 MiB pages as ModelRunner puts a model's weights, so the weight stream is larger than the caches and a shape's
weights are never re-read warm. Reported per call: ms, weight GB/s (bytes the kernel reads per second: the file's
bytes for linear_gguf) with its fraction of `ember::read_bandwidth` (the mean of one measured just before and one
just after that run), and GFLOP/s.

  .venv/bin/python scripts/bench_linear.py                      # everything (a few minutes, on an idle machine)
  .venv/bin/python scripts/bench_linear.py --types Q4_K Q8_0 --rows 1 8
  .venv/bin/python scripts/bench_linear.py --types Q4_K --rows 16 32 64 --paths int8 tile amx --no-old
    (each linear_gguf path forced, ember::linear_gguf_path: the crossings gguf_amx_min_rows / tile_min_rows;
    amx runs once, on the avx512bf16 tier, where the CPU has AMX-BF16)
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType

from engine import huge_pages
from engine.ops.native import SUPPORTED_ISAS
from engine.quant import gguf_blocks as gb
from engine.quant.format import pack
from engine.quant.gguf_repack import repack

# (hidden, kv width, mlp) of the models whose layers are timed (--model)
MODELS = {"llama1b": (2048, 512, 8192), "smollm2": (576, 192, 1536)}


def layer_shapes(hidden: int, kv: int, mlp: int) -> dict[str, tuple[int, int]]:
    """The calls one layer makes, as (n, k): the model stacks the shards of one type into one weight (q|k|v,
    gate|up)."""
    return {f"q|k|v {hidden + 2 * kv}x{hidden}": (hidden + 2 * kv, hidden), f"o {hidden}x{hidden}": (hidden, hidden),
            f"gate|up {2 * mlp}x{hidden}": (2 * mlp, hidden), f"down {hidden}x{mlp}": (hidden, mlp)}


SHAPES = layer_shapes(*MODELS["llama1b"])
ORDER = list(SHAPES)
FP16_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def random_rows(qtype: int, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Random GGUF rows with sane fp16 fields (speed does not depend on the values)."""
    _, block, size = gb.GGUF_TYPES[qtype]
    raw = rng.integers(0, 256, (n, k // block * size), dtype=np.uint8)
    blocks = raw.reshape(n, k // block, size)
    for off in FP16_FIELDS[qtype]:
        val = (np.exp2(rng.uniform(-8, -4, (n, k // block))) * rng.choice([-1.0, 1.0], (n, k // block)))
        blocks[:, :, off:off + 2] = val.astype(np.float16).view(np.uint8).reshape(n, k // block, 2)
    return torch.from_numpy(raw)


def weights(qtype: int, layers: int, rng: np.random.Generator) -> tuple[dict, dict]:
    """Per shape, `layers` distinct copies of one random weight: interleaved GGUF bytes and linear_q's pack."""
    new, old = {}, {}
    for name, (n, k) in SHAPES.items():
        raw = random_rows(qtype, n, k, rng)
        p = pack(repack(raw.numpy(), GGMLQuantizationType(qtype), k))
        copies = layers * ORDER.count(name)
        new[name] = [(gb.interleave(raw, qtype), n) for _ in range(copies)]
        huge_pages.advise(w for w, _ in new[name])  # on 2 MiB pages, as ModelRunner puts a model's weights
        old[name] = [(p.qweight.clone(), p.scales.clone(), None if p.mins is None else p.mins.clone(), p.n)
                     for _ in range(copies)]
    return new, old


def nbytes(w: object) -> int:
    return sum(t.numel() * t.element_size() for t in (w if isinstance(w, tuple) else (w,)) if
               isinstance(t, torch.Tensor))


def run(calls: list, rows: int, passes: int) -> dict[str, tuple[float, int, int]]:
    """Per shape: (seconds per call, bytes per call, flops per call), median over passes of the per-pass mean."""
    xs = {k: torch.randn(rows, k).bfloat16() for _, k in SHAPES.values()}
    per: dict[str, list[float]] = {}
    for p in range(passes + 1):  # pass 0 warms up
        acc: dict[str, list[float]] = {}
        for name, fn, w in calls:
            x = xs[SHAPES[name][1]]
            t0 = time.perf_counter()
            fn(x, w)
            acc.setdefault(name, []).append(time.perf_counter() - t0)
        if p:
            for name, ts in acc.items():
                per.setdefault(name, []).append(sum(ts) / len(ts))
    out = {}
    for name, ts in per.items():
        n, k = SHAPES[name]
        w = next(w for nm, _, w in calls if nm == name)
        out[name] = (float(np.median(ts)), nbytes(w), 2 * rows * n * k)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="*", default=[v[0] for v in gb.GGUF_TYPES.values()])
    ap.add_argument("--rows", nargs="*", type=int, default=[1, 8, 32, 128])
    ap.add_argument("--layers", type=int, default=16, help="distinct layers streamed at <= 8 rows")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", choices=list(MODELS), default="llama1b", help="whose layer shapes to time")
    ap.add_argument("--no-old", action="store_true", help="skip ember::linear_q")
    ap.add_argument("--paths", nargs="*", default=["auto"], help="linear_gguf paths: auto int8 wide tile amx amx8")
    args = ap.parse_args()
    global SHAPES, ORDER
    SHAPES = layer_shapes(*MODELS[args.model])
    ORDER = list(SHAPES)
    torch.set_num_threads(args.threads)
    by_name = {v[0]: t for t, v in gb.GGUF_TYPES.items()}
    tiers = {str(torch.ops.ember.linear_gguf_variant(t)): t for t in reversed(SUPPORTED_ISAS)}
    tiers.pop("scalar", None)
    buf = torch.ones(1 << 30, dtype=torch.uint8)
    rng = np.random.default_rng(0)
    print(f"threads {args.threads}, variants {', '.join(f'{v} (tier {t})' for v, t in tiers.items())}")
    print(f"{'type':5} {'variant':10} {'op':11} {'rows':>4} {'shape':19} {'ms/call':>8} {'GB/s':>6} "
          f"{'read':>5} {'frac':>5} {'GFLOP/s':>8}")
    for tname in args.types:
        qtype = by_name[tname]
        new, old = weights(qtype, args.layers, rng)
        runs = [(v, t, p) for v, t in tiers.items() for p in args.paths if p not in ("amx", "amx8")]
        if "amx" in args.paths and torch.ops.ember.isa_has_amx():
            runs.append(("amx", "avx512bf16", "amx"))
        if "amx8" in args.paths and torch.ops.ember.isa_has_amx_int8() and gb.group_rows(qtype) == 16 and \
                tname != "Q6_K":  # (the amx8 path's types: the 16-row ones but Q6_K)
            runs.append(("amx8", "avx512bf16", "amx8"))
        for variant, tier, path in runs:
            ops = [(f"gguf:{path}" if path != "auto" else "linear_gguf", new,
                    lambda x, w, t=tier, p=path: torch.ops.ember.linear_gguf_path(x, w[0], qtype, w[1], t, p))]
            if not args.no_old and path == args.paths[0]:
                ops.append(("linear_q", old, lambda x, w, t=tier: torch.ops.ember.linear_q_isa(x, *w, t)))
            for op, ws, fn in ops:
                for rows in args.rows:
                    before = torch.ops.ember.read_bandwidth(buf, 3)
                    # many rows: compute-bound, the cache is no help
                    layers = args.layers if rows <= 8 else min(2, args.layers)
                    it = {name: iter(ws[name]) for name in SHAPES}
                    calls = [(name, fn, next(it[name])) for _ in range(layers) for name in ORDER]
                    res = run(calls, rows, args.passes)
                    bw = (before + torch.ops.ember.read_bandwidth(buf, 3)) / 2  # around the run: the machine drifts
                    tot_t = sum(res[nm][0] for nm in ORDER)
                    tot_b = sum(res[nm][1] for nm in ORDER)
                    tot_f = sum(res[nm][2] for nm in ORDER)
                    lines = list(res.items()) + [(f"layer ({len(ORDER)} calls)", (tot_t, tot_b, tot_f))]
                    for name, (t, b, f) in lines:
                        gbs = b / t / 1e9
                        print(f"{tname:5} {variant:10} {op:11} {rows:4d} {name:19} {t * 1e3:8.3f} {gbs:6.1f} "
                              f"{bw:5.1f} {gbs / bw:5.2f} {f / t / 1e9:8.1f}", flush=True)
        del new, old


if __name__ == "__main__":
    main()
