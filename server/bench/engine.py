"""`ember bench-engine`: offline decode tokens/s of Ember's runner (compiled and eager) against transformers
`generate` on the same weights and dtype, in one run, plus compile seconds per bucket.

Decode-only throughput on both sides: Ember times its decode steps after prefill; for transformers the time
of a 1-token generate (prefill) is subtracted from an N-token generate.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from engine.config import EngineConfig


def add_bench_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmark")
    g.add_argument("--batches", default="1,8,32", help="batch sizes to measure (default: %(default)s)")
    g.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default: %(default)s)")
    g.add_argument("--output-len", type=int, default=64, help="decode steps timed (default: %(default)s)")
    g.add_argument("--skip-hf", action="store_true", help="do not run the transformers baseline")
    g.add_argument("--skip-eager", action="store_true", help="do not run Ember's eager step")
    g.add_argument("--json", default=None, help="also write the results to this JSON file")


def _ember_decode_tps(config: EngineConfig, batches: list[int], prompt_len: int, steps: int) -> tuple[dict[int, float], dict[int, float]]:
    import torch  # here, not at the top: `ember bench` builds this parser and must not pay for torch

    from engine.loader import open_checkpoint
    from engine.forward_batch import ForwardBatch, PrefillChunk
    from engine.model_runner import ModelRunner

    runner = ModelRunner(config, open_checkpoint(config.model))
    gen = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    result: dict[int, float] = {}
    for b in batches:
        rows = [runner.req_pool.allocate() for _ in range(b)]
        chunks = []
        for row in rows:
            assert row is not None
            ids = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
            slots = runner.kv_pool.allocate(prompt_len)
            assert slots is not None
            chunks.append(PrefillChunk(row, 0, ids, slots))
        tokens = runner.forward(ForwardBatch.prefill(chunks)).argmax(-1)
        rows_t = torch.tensor(rows, dtype=torch.int64)
        for step in range(steps + 2):
            if step == 2:  # two warm-up steps, then time
                t0 = time.perf_counter()
            slots = runner.kv_pool.allocate(b)
            assert slots is not None
            positions = torch.full((b,), prompt_len + step, dtype=torch.int64)
            tokens = runner.forward(ForwardBatch.decode(tokens, positions, rows_t, slots)).argmax(-1)
        result[b] = b * steps / (time.perf_counter() - t0)
        for row in rows:
            runner.kv_pool.free(runner.req_pool.table[row, : prompt_len + steps + 2].to(torch.int64))
            runner.req_pool.free(row)
    return result, dict(runner.graphs.compile_seconds)


def _hf_decode_tps(config: EngineConfig, batches: list[int], prompt_len: int, steps: int) -> dict[int, float]:
    import torch

    from pathlib import Path

    from transformers import AutoModelForCausalLM, GgufConfig

    from engine.loader import default_model_path

    path = Path(config.model or default_model_path())
    config = config.resolved()  # the same activation dtype Ember runs
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=config.torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
        model = model.to(config.torch_dtype)
    model.eval()
    gen = torch.Generator().manual_seed(0)
    result: dict[int, float] = {}
    for b in batches:
        ids = torch.randint(0, model.config.vocab_size, (b, prompt_len), generator=gen)

        def run(n: int) -> float:
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)
            return time.perf_counter() - t0

        run(2)  # warm-up
        result[b] = b * (steps - 1) / max(run(steps) - run(1), 1e-9)
    return result


def _cell(value: float | None, width: int, fmt: str) -> str:
    """A table cell; "-" for a baseline that was skipped."""
    return f"{value:>{width}{fmt}}" if value else f"{'-':>{width}}"


def run_bench(config: EngineConfig, args: argparse.Namespace) -> int:
    """`config`: the engine flags as given; the buckets, batch and pool sizes are set from the benchmark's own."""
    batches = sorted(int(x) for x in args.batches.split(","))
    base = replace(config, decode_buckets=tuple(batches), max_running_requests=max(batches),
                   max_total_tokens=max(batches) * (args.prompt_len + args.output_len + 8))
    report: dict[str, object] = {"dtype": base.dtype, "prompt_len": args.prompt_len, "output_len": args.output_len}
    compiled, compile_s = _ember_decode_tps(base, batches, args.prompt_len, args.output_len)
    report["ember_compiled_tps"], report["compile_seconds"] = compiled, compile_s
    eager = {} if args.skip_eager else _ember_decode_tps(replace(base, disable_compile=True), batches,
                                                         args.prompt_len, args.output_len)[0]
    report["ember_eager_tps"] = eager
    hf = {} if args.skip_hf else _hf_decode_tps(base, batches, args.prompt_len, args.output_len)
    report["transformers_tps"] = hf
    print(f"{'batch':>5} {'ember compiled':>15} {'ember eager':>12} {'transformers':>13} {'vs hf':>7} {'vs eager':>9}")
    for b in batches:
        c, e, h = compiled[b], eager.get(b), hf.get(b)
        print(f"{b:>5} {c:>15.1f} {_cell(e, 12, '.1f')} {_cell(h, 13, '.1f')} {_cell(h and c / h, 6, '.2f')}x "
              f"{_cell(e and c / e, 8, '.2f')}x")
    print("compile seconds per bucket:", {b: round(s, 1) for b, s in sorted(compile_s.items())})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
