#!/usr/bin/env python3
"""What a quantized KV cache costs in quality: the same teacher-forced positions scored with bf16 KV and with each
quantized KV dtype, in lockstep, as scripts/perplexity.py scores them (llama-perplexity's chunks).

    .venv/bin/python scripts/kv_quality.py [MODEL ...] [--gemma3-shaped] [--ctx 1024] [--text FILE]

MODEL: GGUF files or HF folders (default: the embedded SmolLM2-135M-Instruct). --gemma3-shaped adds a random model
of Gemma 3 270M's shape (18 layers, hidden 640, 4 heads / 1 KV head of 256, window 512 on 5 of every 6 layers)
with SmolLM2's tokenizer, its output head scaled so its next-token distributions are neither flat nor one-hot; with --ctx past the window its window layers read quantized K/V through the window. Per KV dtype: PPL,
the mean KL divergence from the bf16-KV distribution (nats per token), and how often the top token agrees.
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.loader import load_tokenizer, resolve_model_path  # noqa: E402
from perplexity import TEXT, scored_logits, token_ids  # noqa: E402

KV_DTYPES = ("bfloat16", "int8", "fp8_e4m3")
# The random head's scale: transformers' init gives near-flat next-token distributions (entropy 10.7 nats of ln 49152 =
# 10.8), x8 near-one-hot ones; x4 gives a mean entropy of ~1.2 nats, a confident trained model's, where a KV error
# moves probabilities and top tokens as it would there (the perplexity of random text means nothing).
HEAD_SCALE = 4.0


def gemma3_shaped(folder: Path, tokenizer_from: Path) -> Path:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tok = load_tokenizer(str(tokenizer_from))
    cfg = Gemma3TextConfig(vocab_size=len(tok), hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                           max_position_embeddings=32768, query_pre_attn_scalar=256)
    cfg.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():  # (tied: the input side is normed, so only the head's sharpness changes)
        model.get_output_embeddings().weight.mul_(HEAD_SCALE)
    model.to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def compare(path: Path, ids: list[int], ctx: int) -> None:
    runs = [scored_logits(path, ids, "auto", "bfloat16", ctx, 0, kv) for kv in KV_DTYPES]
    next(runs[0])
    for r in runs[1:]:
        next(r)
    nll = {kv: 0.0 for kv in KV_DTYPES}
    kl = {kv: 0.0 for kv in KV_DTYPES}
    agree = {kv: 0 for kv in KV_DTYPES}
    n = 0
    for items in zip(*runs):
        ref_logp = torch.log_softmax(items[0][0], -1)
        targets = items[0][1]
        n += len(targets)
        for kv, (logits, _) in zip(KV_DTYPES, items):
            logp = torch.log_softmax(logits, -1)
            nll[kv] += float(-logp.gather(1, targets[:, None]).sum())
            kl[kv] += float((ref_logp.exp() * (ref_logp - logp)).sum())
            agree[kv] += int((logp.argmax(-1) == ref_logp.argmax(-1)).sum())
    base = math.exp(nll["bfloat16"] / n)
    for kv in KV_DTYPES:
        ppl = math.exp(nll[kv] / n)
        print(f"| {path.name} | {ctx} | {n} | {kv} | {ppl:.4f} ({100 * (ppl / base - 1):+.2f} %) | "
              f"{kl[kv] / n:.5f} | {100 * agree[kv] / n:.2f} % |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", type=Path)
    p.add_argument("--gemma3-shaped", action="store_true")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--text", type=Path, default=TEXT)
    args = p.parse_args()
    text = args.text.read_text()
    text = text[:-1] if text.endswith("\n") else text
    models = list(args.models) or [Path(resolve_model_path(None))]
    print("| model | ctx | scored tokens | KV | PPL (vs bf16 KV) | KL from bf16 KV | top-1 agrees |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        if args.gemma3_shaped:
            models.append(gemma3_shaped(Path(tmp) / "gemma3-270m-shaped", models[0]))
        for path in models:
            compare(path, token_ids(path, text, None), args.ctx)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
