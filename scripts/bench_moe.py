"""Decode tokens/s of a random Qwen3-MoE against a dense Qwen3 with the same ACTIVE parameters per token, and what
the grouped expert path (engine/ops/moe.py) reads per decode step.

    .venv/bin/python scripts/bench_moe.py [--batches 1,8] [--layers 8] [--hidden 768] [--experts 32] [--top-k 4]
                                          [--expert-ffn 384] [--dtype bfloat16] [--eager] [--out DIR]

The dense model's MLP is top_k * expert_ffn wide, so both stream the same attention, head and expert-MLP bytes per
token at batch 1 (the router, [experts, hidden], is the MoE's only extra). At batch B the MoE reads every expert
that any of the B tokens chose: up to B * top_k experts per layer, which the second table counts from the running
op, against the B * top_k expert reads of a per-token loop and the reads of all experts.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

import engine.ops.moe as moe_op
from engine.config import EngineConfig
from engine.loader import open_checkpoint
from engine.forward_batch import ForwardBatch, PrefillChunk
from engine.model_runner import ModelRunner
from server.bench.engine import _ember_decode_tps


def _write(folder: Path, cfg, dtype: torch.dtype) -> Path:
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # spread the routing over the experts, as a trained router does
    model.save_pretrained(folder)
    return folder


def _models(args: argparse.Namespace, root: Path, dtype: torch.dtype) -> tuple[Path, Path]:
    common = dict(vocab_size=32000, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=12,
                  num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)
    moe = Qwen3MoeConfig(**common, num_experts=args.experts, num_experts_per_tok=args.top_k,
                         moe_intermediate_size=args.expert_ffn, intermediate_size=args.top_k * args.expert_ffn,
                         norm_topk_prob=True)
    dense = Qwen3Config(**common, intermediate_size=args.top_k * args.expert_ffn)
    tag = f"h{args.hidden}-l{args.layers}-e{args.experts}-k{args.top_k}-f{args.expert_ffn}-{args.dtype}"
    return _write(root / f"moe-{tag}", moe, dtype), _write(root / f"dense-{tag}", dense, dtype)


def _expert_reads(folder: Path, args: argparse.Namespace, batch: int) -> dict[str, float]:
    """Counts from one eager decode step of `batch` rows: expert linear calls and the weight bytes they read."""
    config = EngineConfig(model=str(folder), dtype=args.dtype, max_total_tokens=batch * 200, max_running_requests=batch,
                          decode_buckets=(batch,), disable_compile=True)
    runner = ModelRunner(config, open_checkpoint(str(folder)))
    gen = torch.Generator().manual_seed(1)
    rows, chunks = [], []
    for _ in range(batch):
        row, slots = runner.req_pool.allocate(), runner.kv_pool.allocate(args.prompt_len)
        assert row is not None and slots is not None
        rows.append(row)
        chunks.append(PrefillChunk(row, 0, torch.randint(0, 32000, (args.prompt_len,), generator=gen).tolist(), slots))
    tokens = runner.forward(ForwardBatch.prefill(chunks)).argmax(-1)
    calls: list[tuple[int, int, int, int]] = []  # (stack, expert, rows, weight bytes)
    original = moe_op._expert_linear

    def counting(x, w, scales, mins, e, n):  # noqa: ANN001, ANN202
        nbytes = w[e].nbytes + (0 if scales is None else scales[e].nbytes) + (0 if mins is None else mins[e].nbytes)
        calls.append((w.data_ptr(), e, x.shape[0], nbytes))
        return original(x, w, scales, mins, e, n)

    moe_op._expert_linear = counting
    try:
        slots = runner.kv_pool.allocate(batch)
        assert slots is not None
        runner.forward(ForwardBatch.decode(tokens, torch.full((batch,), args.prompt_len), torch.tensor(rows), slots))
    finally:
        moe_op._expert_linear = original
    assert len({(c[0], c[1]) for c in calls}) == len(calls), "an expert's weight was read twice in one step"
    stacks = [w for layer in runner.model.layers if layer.moe is not None
              for w in (layer.moe.gate_up_proj, layer.moe.down_proj)]
    per_expert = sum(w.nbytes for w in stacks) / (len(stacks) // 2) / args.experts  # gate_up + down, one expert
    layers = len(stacks) // 2
    active = len(calls) // 2
    return {
        "linear_calls": len(calls),
        "active_experts": active,
        "token_expert_pairs": batch * args.top_k * layers,
        "rows_through_experts": sum(c[2] for c in calls) // 2,
        "mib_read": sum(c[3] for c in calls) / 2**20,
        "mib_per_token_loop": batch * args.top_k * layers * per_expert / 2**20,
        "mib_all_experts": args.experts * layers * per_expert / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--expert-ffn", type=int, default=384)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--eager", action="store_true", help="time the eager step instead of the compiled one")
    p.add_argument("--out", default=None, help="where the random models are written (default: a temporary folder)")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    dtype = getattr(torch, args.dtype)
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ember-bench-moe-"))
    t0 = time.perf_counter()
    moe, dense = _models(args, root, dtype)
    print(f"models in {root} ({time.perf_counter() - t0:.0f} s): hidden {args.hidden}, {args.layers} layers, "
          f"{args.experts} experts top-{args.top_k} of ffn {args.expert_ffn} vs dense ffn {args.top_k * args.expert_ffn}, "
          f"{args.dtype}, {'eager' if args.eager else 'compiled'} decode, {args.prompt_len}-token prompts, "
          f"{args.steps} timed steps")
    results: dict[str, dict[int, float]] = {}
    for name, folder in (("moe", moe), ("dense", dense)):
        config = EngineConfig(model=str(folder), dtype=args.dtype, max_total_tokens=max(batches) * 400,
                              max_running_requests=max(batches), decode_buckets=tuple(batches),
                              disable_compile=args.eager)
        results[name], compile_s = _ember_decode_tps(config, batches, args.prompt_len, args.steps)
        if compile_s and not args.eager:
            print(f"  {name}: compile " + ", ".join(f"bucket {b}: {s:.0f} s" for b, s in sorted(compile_s.items())))
    print("\nbatch | MoE tok/s | dense tok/s | MoE / dense")
    for b in batches:
        m, d = results["moe"][b], results["dense"][b]
        print(f"{b:5d} | {m:9.1f} | {d:11.1f} | {m / d:10.2f}")
    print("\nper decode step, all sparse layers (one eager step, counted inside ember::moe_experts):")
    print("batch | expert linear calls | active experts | token x top-k pairs | expert MiB read | "
          "per-token loop MiB | all experts MiB")
    for b in batches:
        r = _expert_reads(moe, args, b)
        print(f"{b:5d} | {r['linear_calls']:19d} | {r['active_experts']:14d} | {r['token_expert_pairs']:19d} | "
              f"{r['mib_read']:15.1f} | {r['mib_per_token_loop']:18.1f} | {r['mib_all_experts']:15.1f}")


if __name__ == "__main__":
    main()
