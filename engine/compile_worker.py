"""The compile child's side (`python -m engine.compile_worker`, started by engine/compile_child.py CompileChild): build
the server's runner from the prepared copy with a tiny KV pool, compile the buckets it is given at the lowest CPU
priority with one thread, save each where the server looks for it and announce it on stdout."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from engine.compile_child import CHILD_SLOTS, READY
from engine.config import EngineConfig
from engine.gc_freeze import load_then_freeze

log = logging.getLogger("ember.compile")


def _lowest_priority() -> str:
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # runs only on a core nothing else wants
        return "SCHED_IDLE"
    except (AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, 0, 19)
        return "nice 19"


def _exit_when_stdin_closes() -> None:
    def watch() -> None:
        sys.stdin.read()  # returns at EOF: the server is gone (or closed the pipe to stop us)
        os._exit(0)

    threading.Thread(target=watch, name="ember-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="compile decode buckets for a running server (engine/compile_child.py)")
    p.add_argument("--config", required=True, help="the server's resolved EngineConfig as JSON")
    p.add_argument("--buckets", required=True, help="comma-separated buckets to compile, in order")
    p.add_argument("--artifact-dir", required=True, help="the server's saved-steps folder: checked, not chosen")
    a = p.parse_args(argv)
    priority = _lowest_priority()
    _exit_when_stdin_closes()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s compile-child %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)  # its bucket lines; the runner's load lines would repeat the server's
    import torch

    from engine.decode_graphs import DecodeGraphs, DecodeStepModule
    from engine.loader import resolve_model_path
    from engine.loader.prepared import PreparedModel, open_cached
    from engine.model_runner import ModelRunner

    torch.set_num_threads(1)
    fields = json.loads(a.config)
    fields["decode_buckets"] = tuple(fields["decode_buckets"])
    served = EngineConfig(**fields)
    # A tiny pool, no compile of its own (the runner's graphs stay eager), one thread.
    config = dataclasses.replace(served, max_total_tokens=CHILD_SLOTS, disable_compile=True, background_compile=False,
                                 num_threads=1)
    assert config.compile_cache_dir, "the compile child needs the server's --compile-cache-dir"
    t0 = time.perf_counter()
    with load_then_freeze():  # the compile's own collections then skip the model's objects
        prepared = PreparedModel(config.compile_cache_dir, resolve_model_path(config.model))
        runner = ModelRunner(config, open_cached(config.model, prepared), prepared=prepared)
    artifact_dir = runner._decode_artifact_dir()
    if artifact_dir != Path(a.artifact_dir):
        log.error("the compile child names its saved steps %s, the server %s: not compiling", artifact_dir,
                  a.artifact_dir)
        return 2
    buckets = [int(b) for b in a.buckets.split(",")]
    log.info("compiling decode buckets %s at %s priority with 1 thread (model loaded in %.1f s)", buckets, priority,
             time.perf_counter() - t0)
    graphs = DecodeGraphs(DecodeStepModule(runner.model), tuple(buckets), True, config.cpp_wrapper,
                          artifact_dir=artifact_dir)

    def report(bs: int, secs: float) -> None:
        print(f"{READY} {bs} {secs:.3f}", flush=True)

    graphs.capture(runner.req_pool.table, runner.k_caches, runner.v_caches, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
