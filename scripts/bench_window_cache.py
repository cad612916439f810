"""A long system prompt reused on a sliding-window model: TTFT of a request whose system prompt is cached against
the same request cold, through the engine (chunked prefill, the prefix cache, the window layers' K/V in slots of their
own), on the random Gemma-3-270M-shaped model of scripts/bench_window.py. Also prints what the KV costs a token.

Each round sends system + question i, one request at a time, to an engine with the prefix cache on (round 0 is
cold, later rounds find the system prompt cached) and the same to an engine with it off (rings, every prompt cold).
Prints the median TTFT of each and the ratio. Usage: python scripts/bench_window_cache.py [--system 1000]
[--question 24] [--rounds 4] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_window import write_model  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def ttft(core: EngineCore, prompt: list[int]) -> float:
    """Seconds from adding the request to its first token (the request then runs to its one token)."""
    t0 = time.perf_counter()
    core.add(core.make_requests(f"r{t0}", prompt, SamplingParams(max_tokens=1, temperature=0.0)))
    while core.has_work():
        if any(o.token_ids for o in core.step()):
            return time.perf_counter() - t0
    raise RuntimeError("no token")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", type=int, default=1000)
    ap.add_argument("--question", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(2)
    system = torch.randint(3, 16384, (args.system,), generator=g).tolist()
    questions = [torch.randint(3, 16384, (args.question,), generator=g).tolist() for _ in range(args.rounds + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(Path(tmp) / "gemma3-270m-shaped", args.system + args.question + 64)
        results, memory = {}, ""
        for name, cache in (("prefix cache (window slots)", True), ("no cache (rings)", False)):
            core = EngineCore(EngineConfig(model=str(folder), dtype=args.dtype, max_running_requests=2,
                                           decode_buckets=(1, 2), disable_compile=True, max_total_tokens=8192,
                                           disable_prefix_cache=not cache, speculative="off"))
            ttft(core, questions[-1][:8] * 8)  # warm up first-call costs (no shared prefix with what follows)
            times = [ttft(core, system + q) for q in questions[: args.rounds]]
            results[name] = (times[0], statistics.median(times[1:]))
            if cache:
                memory = _memory(core)
            del core
    print(f"system prompt {args.system} tokens, question {args.question}, {args.dtype}, "
          f"torch threads {torch.get_num_threads()}")
    for name, (cold, warm) in results.items():
        print(f"{name:28} cold TTFT {cold * 1e3:8.1f} ms   later rounds {warm * 1e3:8.1f} ms   ratio {warm / cold:.3f}")
    print(memory)


def _memory(core: EngineCore) -> str:
    """A token's bytes in the token pool, the window slots' size and use, against every layer in the token pool."""
    kv, ws = core.runner.kv_pool, core.runner.kv_pool.window
    assert ws is not None
    win = 2 * len(ws.k) * ws.k[0][0].numel() * ws.k[0].itemsize
    return (f"KV: token pool {core.runner.kv_bytes_per_token} B a token ({len(kv.k)} full layers, {kv.num_slots} "
            f"slots, {kv.used_size()} cached now); window layers {ws.num_slots} slots of {win} B ({len(ws.k)} layers, "
            f"{ws.used_size()} in use now); every layer in the token pool would be "
            f"{core.runner.kv_bytes_per_token + win} B a token")


if __name__ == "__main__":
    main()
