"""`ember compile`: build the engine once (which compiles every configured decode bucket into the compile cache
directory), report what the inductor caches did, and exit. A Docker image runs it at build time so that its
containers start with the cache filled.

The cache only helps a later `ember serve` whose settings produce the same graphs: same model, dtype, quantization,
buckets, max running requests and context length. Not the KV pool size: the steps are compiled with the pool's slot
count symbolic, so a server that sizes its pool from the memory free at start (or another --max-total-tokens) loads
them all the same.
"""
from __future__ import annotations

import logging
import time

from engine.config import EngineConfig

log = logging.getLogger("ember.compile")


def inductor_cache_counters() -> dict[str, int]:
    """FX graph cache and AOTAutograd cache hits / misses / bypasses so far in this process."""
    from torch._dynamo.utils import counters

    names = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")
    out = {n: int(counters["inductor"][n]) for n in names}
    for n in ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass"):
        out[n] = int(counters["aot_autograd"][n])
    return out


def run_compile(config: EngineConfig) -> int:
    if config.disable_compile:
        raise ValueError("ember compile with --disable-compile has nothing to compile")
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from engine.core import EngineCore

    t0 = time.perf_counter()
    core = EngineCore(config)  # compiles every bucket, largest first, and sets TORCHINDUCTOR_CACHE_DIR
    graphs = core.runner.graphs
    c = inductor_cache_counters()
    log.info("compiled decode buckets %s in %.1f s total (%s) into %s", list(graphs.buckets),
             time.perf_counter() - t0, ", ".join(f"{b}: {s:.1f} s" for b, s in sorted(graphs.compile_seconds.items())),
             cache_dir())
    log.info("inductor FX graph cache: %d hit, %d miss, %d bypass; AOTAutograd cache: %d hit, %d miss, %d bypass",
             c["fxgraph_cache_hit"], c["fxgraph_cache_miss"], c["fxgraph_cache_bypass"],
             c["autograd_cache_hit"], c["autograd_cache_miss"], c["autograd_cache_bypass"])
    if graphs.artifact_dir is not None:
        log.info("saved decode steps in %s (a restart loads them instead of compiling)", graphs.artifact_dir)
    if not config.compile_cache_dir:
        log.warning("no --compile-cache-dir (or EMBER_COMPILE_CACHE_DIR) was set: the cache went to torch's "
                    "default directory, which a container restart loses")
    return 0
