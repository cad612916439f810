"""Decode step time with an int8 KV cache against a bf16 one (--kv-cache-dtype), at long context.

A random SmolLM2-135M-shaped Llama (30 layers, hidden 576, 9 query heads and 3 KV heads of 64, vocabulary 49152;
`--layers` makes it shallower) is served twice from the same weights, eagerly, with bf16 activations: once with a
bf16 KV pool, once with int8. Each of `--batch` requests already holds `--context` positions: the pool is filled with
random K/V rather than prefilled (prefilling 64k tokens would take minutes here, and attention's cost does not depend
on the values), then `--steps` decode steps run on all requests together. Prints the pool's bytes per token, the KV
bytes each step reads, and the median step time of each, with the ratios.

  python scripts/bench_kv_dtype.py                     # batch 8, 8192 positions each, 8 steps
  python scripts/bench_kv_dtype.py --context 4096 --layers 12 --kv bfloat16 int8 fp8_e4m3
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import EngineConfig
from engine.forward_batch import ForwardBatch
from engine.loader import open_checkpoint
from engine.model_runner import ModelRunner
from engine.ops.kv_quant import is_quantized, quantize_rows


def write_model(folder: Path, layers: int, context: int) -> Path:
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=context + 64,
                      tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    return folder


def fill(runner: ModelRunner, batch: int, context: int) -> list[int]:
    """`batch` requests of `context` positions each, their K/V random (one random layer copied into every layer)."""
    rows = []
    slots = runner.kv_pool.allocate(batch * context)
    assert slots is not None
    g = torch.Generator().manual_seed(1)
    kvh, dim = runner.model_config.num_kv_heads, runner.model_config.head_dim
    layer = torch.randn(runner.kv_pool.num_slots + 1, kvh, dim, generator=g)
    dtype = runner.kv_pool.dtype
    rows_of = quantize_rows(layer, dtype) if is_quantized(runner.k_caches[0]) else layer.to(dtype)
    for cache in (*runner.k_caches, *runner.v_caches):
        cache.view(torch.uint8).copy_(rows_of.view(torch.uint8))  # (bytes: fp8 tensors have no copy kernel here)
    for i in range(batch):
        row = runner.req_pool.allocate()
        assert row is not None
        runner.req_pool.table[row, :context] = slots[i * context : (i + 1) * context].to(torch.int32)
        rows.append(row)
    return rows


def measure(runner: ModelRunner, rows: list[int], context: int, steps: int) -> float:
    """Median ms of a decode step of all rows (after one warm-up step)."""
    times = []
    ids = torch.full((len(rows),), 5, dtype=torch.int64)
    for step in range(steps + 1):
        slots = runner.kv_pool.allocate(len(rows))
        assert slots is not None
        positions = torch.full((len(rows),), context + step, dtype=torch.int64)
        t0 = time.perf_counter()
        logits = runner.forward(ForwardBatch.decode(ids, positions, torch.tensor(rows), slots))
        times.append(time.perf_counter() - t0)
        ids = logits.argmax(-1)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192, help="positions each request already holds")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv", nargs="+", default=["bfloat16", "int8"], help="KV dtypes to time; bfloat16 first")
    args = ap.parse_args()
    results: dict[str, tuple[int, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(Path(tmp) / "smollm2-shaped", args.layers, args.context)
        for kv in args.kv:
            config = EngineConfig(model=str(folder), dtype="bfloat16", kv_cache_dtype=kv, quantization="none",
                                  max_running_requests=args.batch, decode_buckets=(args.batch,), disable_compile=True,
                                  max_total_tokens=args.batch * (args.context + args.steps + 1),
                                  max_context_len=args.context + args.steps + 1)
            runner = ModelRunner(config, open_checkpoint(str(folder)))
            rows = fill(runner, args.batch, args.context)
            results[kv] = (runner.kv_bytes_per_token, measure(runner, rows, args.context, args.steps))
            del runner
    print(f"batch {args.batch}, {args.context} positions each, {args.layers} layers, bf16 activations, eager, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'KV':18} {'bytes/token':>12} {'KV MiB read/step':>17} {'decode ms/step':>15}")
    for kv, (per_token, ms) in results.items():
        print(f"{kv:18} {per_token:12d} {per_token * args.batch * args.context / 2**20:17.0f} {ms:15.1f}")
    b_bytes, b_ms = results[args.kv[0]]
    for kv, (per_token, ms) in list(results.items())[1:]:
        print(f"{args.kv[0] + '/' + kv:18} {b_bytes / per_token:11.2f}x {'':17} {b_ms / ms:14.2f}x")


if __name__ == "__main__":
    main()
