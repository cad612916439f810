"""Peak resident memory of loading a model, on a first start (an empty cache: the checkpoint is parsed, converted
and its prepared copy written) and on a restart (the prepared copy read back), each in a fresh process.

Builds an EngineCore with eager decode (no compile: its memory is not the load's) and a fixed KV pool, then prints
the process's peak RSS (ru_maxrss), its RSS once loaded, the weights' bytes in memory and the file's, and the
pool's bytes. The same numbers the server logs at start, without serving.

  python scripts/load_rss.py ~/.cache/ember-peers/synthetic/llama1b/Q4_K_M.gguf
  python scripts/load_rss.py MODEL --max-total-tokens 16384 --kv-cache-dtype int8
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time


def child(model: str, cache: str, tokens: int, kv_dtype: str) -> None:
    import resource

    import psutil

    from engine.config import EngineConfig
    from engine.core import EngineCore

    t0 = time.perf_counter()
    core = EngineCore(EngineConfig(model=model, compile_cache_dir=cache, max_total_tokens=tokens,
                                   disable_compile=True, kv_cache_dtype=kv_dtype, max_running_requests=8))
    runner = core.runner
    pool = sum(k.numel() * k.element_size() for k in runner.k_caches + runner.v_caches)
    print(json.dumps({"seconds": round(time.perf_counter() - t0, 1),
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "rss_mib": psutil.Process().memory_info().rss / 2**20,
                      "weights_mib": runner.weight_bytes / 2**20, "file_mib": runner.file_bytes / 2**20,
                      "kv_pool_mib": pool / 2**20}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--cache-dir", help="compile cache to use (default: a fresh temporary one, so a first start)")
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._child:
        child(a.model, a.cache_dir, a.max_total_tokens, a.kv_cache_dtype)
        return
    with tempfile.TemporaryDirectory() as tmp:
        cache = a.cache_dir or tmp
        for label in ("first start", "restart"):
            out = subprocess.run([sys.executable, __file__, a.model, "--_child", "--cache-dir", cache,
                                  "--max-total-tokens", str(a.max_total_tokens), "--kv-cache-dtype", a.kv_cache_dtype],
                                 check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            r = json.loads(out)
            print(f"{label:12s} peak RSS {r['peak_rss_mib']:7.0f} MiB, RSS loaded {r['rss_mib']:7.0f} MiB, "
                  f"weights {r['weights_mib']:.0f} MiB (file {r['file_mib']:.0f} MiB), KV pool "
                  f"{r['kv_pool_mib']:.0f} MiB, {r['seconds']} s")


if __name__ == "__main__":
    main()
