"""The prefix cache's disk tier across a restart: TTFT of a request whose long prefix another process cached, read
back from disk, against computing it (engine/kv_disk.py).

For each model: engine A (disk tier on, a fresh cache directory) serves prefix + question 0 and closes (its blocks
are written through); engine B, a new engine on the same directory as after a restart, serves prefix + question 1:
its prefix comes from disk. Engine C (no disk tier) serves prefix + question 1 cold: the recompute. Prints the
TTFTs and B / C. Models: the default SmolLM2 and, with --llama1b, a random Llama-3.2-1B-shaped bf16 model (hidden
2048, 16 layers, 32/8 heads, MLP 8192; ~2.5 GB written to a temp dir).
Usage: python scripts/bench_kv_disk.py [--prefix 2000] [--llama1b]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_window_cache import ttft  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402


def llama1b(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      tie_word_embeddings=True, torch_dtype="bfloat16")
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    from engine.loader import load_tokenizer

    load_tokenizer(None).save_pretrained(folder)  # SmolLM2's (the embedded GGUF's): the same 49152 ids
    return folder


def measure(name: str, model: str | None, prefix_len: int, tmp: Path) -> None:
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(10, 40000, (prefix_len,), generator=g).tolist()
    questions = [torch.randint(10, 40000, (16,), generator=g).tolist() for _ in range(2)]
    base = dict(model=model, max_total_tokens=8192, max_running_requests=2, decode_buckets=(1, 2),
                disable_compile=True, speculative="off")
    cache = tmp / f"cache-{name}"
    a = EngineCore(EngineConfig(**base, compile_cache_dir=str(cache), kv_disk_cache_size=4096))
    ttft(a, questions[0][:4])  # warm up first-call costs
    cold_a = ttft(a, prefix + questions[0])
    a.close()
    del a
    b = EngineCore(EngineConfig(**base, compile_cache_dir=str(cache), kv_disk_cache_size=4096))
    ttft(b, questions[1][:4])
    from_disk = ttft(b, prefix + questions[1])
    hit = b.kvm.disk.stats.hit_tokens if b.kvm.disk is not None else 0
    b.close()
    del b
    c = EngineCore(EngineConfig(**base, disable_prefix_cache=True))
    ttft(c, questions[1][:4])
    recompute = ttft(c, prefix + questions[1])
    print(f"{name:10} prefix {prefix_len}: first start {cold_a * 1e3:8.1f} ms, after a restart (disk, {hit} tokens "
          f"read) {from_disk * 1e3:8.1f} ms, recompute {recompute * 1e3:8.1f} ms: {from_disk / recompute:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=2000)
    ap.add_argument("--llama1b", action="store_true")
    args = ap.parse_args()
    print(f"torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp:
        measure("smollm2", None, args.prefix, Path(tmp))
        if args.llama1b:
            measure("llama1b", str(llama1b(Path(tmp) / "llama1b")), args.prefix, Path(tmp))


if __name__ == "__main__":
    main()
