#!/usr/bin/env python3
"""Perplexity of Ember's forward on a fixed text, computed the way llama.cpp's `llama-perplexity` does, so the two
can be compared on the same GGUF file.

    .venv/bin/python scripts/perplexity.py FILE.gguf [FILE.gguf ...] [--text scripts/data/gpl-3.txt]
        [--quantization auto] [--dtype bfloat16] [--ctx 512] [--llama-tokenize PATH] [--kv-cache-dtype int8]

llama-perplexity's rule (tools/perplexity/perplexity.cpp, default flags): the text (one trailing newline dropped)
is tokenized once, cut into floor(n / ctx) chunks of ctx tokens, each evaluated from an empty KV cache; only the
second half of each chunk is scored: the logits at positions ctx/2 .. ctx-2 against the next token (ctx/2 - 1
tokens a chunk). No BOS is added for SmolLM2 (its GGUF says add_bos_token = false). PPL = exp(mean NLL), and the
+- is PPL * the standard error of the NLLs, as llama.cpp prints it. With --llama-tokenize, Ember reads llama.cpp's
own token ids (its pre-tokenizer splits "\\n\\n  " differently from transformers' on this text: 7638 against
7658 tokens), so both score exactly the same tokens.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.config import EngineConfig  # noqa: E402
from engine.loader import load_tokenizer, open_checkpoint  # noqa: E402
from engine.forward_batch import ForwardBatch, PrefillChunk  # noqa: E402
from engine.model.weights import build_model  # noqa: E402
from engine.ops.kv_quant import row_elements  # noqa: E402
from engine.quant.module import describe_weights  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "gpl-3.txt"


def token_ids(path: Path, text: str, llama_tokenize: str | None) -> list[int]:
    if llama_tokenize:
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:  # its -f reads the file verbatim
            f.write(text)
            f.flush()
            out = subprocess.run([llama_tokenize, "-m", str(path), "-f", f.name, "--ids", "--log-disable",
                                  "--no-bos"], capture_output=True, text=True, check=True).stdout
        return [int(t) for t in out.strip().strip("[]").split(",") if t.strip()]
    return list(load_tokenizer(str(path))(text, add_special_tokens=False)["input_ids"])


@torch.no_grad()
def scored_logits(path: Path, ids: list[int], quantization: str, dtype: str, ctx: int, rows_per_call: int = 0,
                  kv_cache_dtype: str = "auto") -> Iterator[tuple[torch.Tensor, torch.Tensor] | str]:
    """Yields the weights' description, then (fp32 logits [n, V], next tokens [n]) of every scored stretch, in
    llama-perplexity's order. rows_per_call: 0 runs each context as one prefill (every linear call has ctx rows:
    the kernels' many-row path); N > 0 runs it in chunks of N tokens over the growing KV cache, so every linear call
    has N rows: with N < 16 the few-row path that decode steps take (int8 activations in ember::linear_gguf), scored
    on the same tokens. kv_cache_dtype: the KV cache's storage (--kv-cache-dtype; int8 / fp8 rows carry their
    scale)."""
    cfg = EngineConfig(model=str(path), dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    ck = open_checkpoint(str(path))
    keep, mode = cfg.quantization_plan(ck.quantized_source)
    model = build_model(ck.config, ck.tensors(keep), cfg.torch_dtype, ctx, quantize=mode, group=cfg.quant_group_size)
    yield describe_weights(model, dtype)
    mc = ck.config
    first = ctx // 2
    step = rows_per_call
    for c in range(len(ids) // ctx):
        chunk = torch.tensor(ids[c * ctx:(c + 1) * ctx])
        kv_dtype, row = cfg.kv_torch_dtype, row_elements(mc.head_dim, cfg.kv_torch_dtype)
        k = [torch.zeros(ctx, mc.num_kv_heads, row, dtype=kv_dtype) for _ in range(mc.num_layers)]
        v = [torch.zeros_like(t) for t in k]
        # The unscored first half fills the cache in one call (its numerics do not count), then the scored
        # positions first .. ctx - 2 go in calls of `step` rows.
        bounds = [0, *range(first, ctx - 1, step), ctx - 1] if rows_per_call else [0, ctx]
        for start, end in zip(bounds, bounds[1:]):
            # One request in row 0 whose slot for position p is p (an identity table).
            part = PrefillChunk(0, start, chunk[start:end].tolist(), torch.arange(start, end))
            batch = ForwardBatch.prefill([part]).with_table(torch.arange(ctx, dtype=torch.int32).unsqueeze(0))
            rows = torch.arange(max(first, start), min(end, ctx - 1))
            if not len(rows):  # the fill: only its last row's logits are computed, and dropped
                model(batch, k, v)
                continue
            yield model(dataclasses.replace(batch, logit_rows=rows - start), k, v).float(), chunk[rows + 1]


def perplexity(path: Path, ids: list[int], quantization: str, dtype: str, ctx: int,
               rows_per_call: int = 0, kv_cache_dtype: str = "auto") -> tuple[float, float, str]:
    """(PPL, its +-, the weights' description) over the scored positions of `scored_logits`."""
    nlls: list[float] = []
    weights = ""
    for item in scored_logits(path, ids, quantization, dtype, ctx, rows_per_call, kv_cache_dtype):
        if isinstance(item, str):
            weights = item
            continue
        logits, targets = item
        nlls += torch.nn.functional.cross_entropy(logits, targets, reduction="none").tolist()
    mean = sum(nlls) / len(nlls)
    var = sum((x - mean) ** 2 for x in nlls) / (len(nlls) - 1)
    ppl = math.exp(mean)
    return ppl, ppl * math.sqrt(var / len(nlls)), weights


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float32", "int8", "fp8_e4m3"])
    p.add_argument("--llama-tokenize", default=None, help="llama.cpp's llama-tokenize, for its token ids")
    p.add_argument("--rows-per-call", type=int, default=0,
                   help="score in chunks of this many tokens (< 16: the decode kernels' path); 0: one prefill")
    args = p.parse_args()
    text = args.text.read_text()
    text = text[:-1] if text.endswith("\n") else text  # llama.cpp's -f drops one trailing newline
    print("| file | quantization | dtype | rows per call | tokens | chunks | PPL | weights |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in args.files:
        ids = token_ids(path, text, args.llama_tokenize)
        ppl, err, weights = perplexity(path, ids, args.quantization, args.dtype, args.ctx, args.rows_per_call,
                                       args.kv_cache_dtype)
        print(f"| {path.name} | {args.quantization} | {args.dtype} / KV {args.kv_cache_dtype} | "
              f"{args.rows_per_call or args.ctx} | {len(ids)} | "
              f"{len(ids) // args.ctx} | "
              f"{ppl:.4f} +- {err:.4f} | {weights} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
