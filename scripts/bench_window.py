"""What Gemma 3's sliding window saves: KV memory, prefill time and decode time, rings and window slots against full
attention.

A random Gemma-3-270M-shaped model (18 layers, every 6th global, window 512, hidden 640, 4 query heads and 1 KV head
of 256; a 16k vocabulary so the head does not drown the attention) is served twice from the same weights:
- rings: the window layers keep the last 512 positions per request (engine/pools.py WindowKVPool);
- slots: the prefix cache's layout, the window layers in slots of their own read through the token-slot map
  (engine/window_slots.py); its KV is the token pool plus the window pool at its floor (what a served engine needs:
  here the requests run without the engine's trimming, so the runner gets a window slot per token);
- full: the same layers attend over the whole context from the token pool (window_layers emptied), i.e. the KV and
  attention work of an engine without window support, before any masking it would add.
Both prefill the same long prompts (one request at a time) and then decode them together; prints bytes, seconds
and the ratios. Usage: python scripts/bench_window.py [--context 4096] [--batch 4] [--steps 32] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from engine.config import EngineConfig
from engine.loader import open_checkpoint
from engine.forward_batch import ForwardBatch, PrefillChunk
from engine.model_runner import ModelRunner, window_slot_floor


def write_model(folder: Path, context: int) -> Path:
    cfg = Gemma3TextConfig(vocab_size=16384, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                           sliding_window=512, max_position_embeddings=max(context + 64, 1024), bos_token_id=2,
                           eos_token_id=1, pad_token_id=0)
    cfg.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    Gemma3ForCausalLM(cfg).save_pretrained(folder)
    return folder


def runner_for(folder: Path, args: argparse.Namespace, layout: str) -> ModelRunner:
    checkpoint = open_checkpoint(str(folder))
    if layout == "full":
        checkpoint = dataclasses.replace(checkpoint, config=dataclasses.replace(checkpoint.config, window_layers=()))
    # Rings are the window layers' home with the prefix cache off (engine/model_runner.py _make_pools), slots with it on.
    config = EngineConfig(model=str(folder), dtype=args.dtype, max_running_requests=args.batch,
                          max_total_tokens=args.batch * (args.context + args.steps + 1), decode_buckets=(args.batch,),
                          disable_compile=True, max_context_len=args.context + args.steps + 1,
                          disable_prefix_cache=layout == "rings", window_kv_ratio=1.0)
    return ModelRunner(config, checkpoint)


def kv_bytes(runner: ModelRunner) -> int:
    """The K/V buffers' bytes; for window slots, the token pool's plus the window pool at its floor."""
    ws = runner.kv_pool.window
    if ws is None:
        return sum(k.numel() * k.element_size() * 2 for k in runner.k_caches)
    per_slot = 2 * len(ws.k) * ws.k[0][0].numel() * ws.k[0].itemsize
    pool = sum(k.numel() * k.element_size() * 2 for k in runner.kv_pool.k)
    return pool + (window_slot_floor(runner.config, runner.model_config.sliding_window) + 1) * per_slot


def measure(runner: ModelRunner, prompts: list[list[int]], steps: int) -> dict[str, float]:
    kv = kv_bytes(runner)
    rows, seqs, prefill = [], [], []
    for p in prompts:
        row, slots = runner.req_pool.allocate(), runner.kv_pool.allocate(len(p))
        assert row is not None and slots is not None
        t0 = time.perf_counter()
        logits = runner.forward(ForwardBatch.prefill([PrefillChunk(row, 0, p, slots)]))
        prefill.append(time.perf_counter() - t0)
        rows.append(row)
        seqs.append(p + [int(logits[0].argmax())])
    step_s = []
    for _ in range(steps):
        slots = runner.kv_pool.allocate(len(rows))
        assert slots is not None
        positions = torch.tensor([len(s) - 1 for s in seqs])
        t0 = time.perf_counter()
        ids = torch.tensor([s[-1] for s in seqs])
        logits = runner.forward(ForwardBatch.decode(ids, positions, torch.tensor(rows), slots))
        step_s.append(time.perf_counter() - t0)
        seqs = [s + [int(t)] for s, t in zip(seqs, logits.argmax(-1))]
    return {"kv_gib": kv / 2**30, "prefill_s": statistics.median(prefill), "step_ms": statistics.median(step_s) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096, help="prompt length of each request")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(Path(tmp) / "gemma3-270m-shaped", args.context)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 16384, (args.context,), generator=g).tolist() for _ in range(args.batch)]
        results = {}
        for name in ("rings", "slots", "full"):
            runner = runner_for(folder, args, name)
            measure(runner, [prompts[0][:600]], 2)  # warm up: first-call costs
            runner = runner_for(folder, args, name)
            results[name] = measure(runner, prompts, args.steps)
            del runner
    r, f, w = results["rings"], results["full"], results["slots"]
    print(f"context {args.context}, batch {args.batch}, {args.dtype}, torch threads {torch.get_num_threads()}")
    print(f"{'':10} {'KV GiB':>8} {'prefill s/prompt':>17} {'decode ms/step':>15}")
    for name, m in results.items():
        print(f"{name:10} {m['kv_gib']:8.3f} {m['prefill_s']:17.2f} {m['step_ms']:15.1f}")
    print(f"{'full/rings':10} {f['kv_gib'] / r['kv_gib']:8.2f}x {f['prefill_s'] / r['prefill_s']:16.2f}x "
          f"{f['step_ms'] / r['step_ms']:14.2f}x")
    print(f"{'slots/rings':10} {w['kv_gib'] / r['kv_gib']:8.2f}x {w['prefill_s'] / r['prefill_s']:16.2f}x "
          f"{w['step_ms'] / r['step_ms']:14.2f}x")


if __name__ == "__main__":
    main()
