"""Compile decode buckets in a child process at the lowest CPU priority, out of the serving process's way.

A compile in the serving process holds its GIL and both cores for minutes: two streaming clients got 0.8 tok/s
each while the default model's buckets compiled in a thread, against 70-86 once they were ready. The child
(`python -m engine.compile_worker`) builds the same runner from the prepared copy of the model in the compile cache,
with the same resolved flags but a tiny KV pool (the saved steps' slot dimension is symbolic, engine/decode_graphs.py),
compiles the buckets it is given with one thread under SCHED_IDLE (nice 19 where that is refused), saves each one
atomically where the server looks for it, and prints `ready BUCKET SECONDS` on stdout. The server loads each saved step
as its line arrives (DecodeGraphs._compile_in_child).

The child exits when its stdin closes, so it never outlives the server, even one killed with SIGKILL.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil

from engine.config import EngineConfig

log = logging.getLogger("ember.compile")

CHILD_SLOTS = 61  # the child's KV pool (a prime, so it matches no other size of the graph); any size loads later
READY = "ready"
# Besides its copy of the weights: the interpreter, torch, Inductor's compile of one bucket and the tiny pool.
CHILD_OVERHEAD_BYTES = 1 << 30


class NoRoomForChild(RuntimeError):
    """A compile child would not fit in memory beside the server: the buckets stay eager (see room_for_child)."""


def room_for_child(weight_bytes: int, server_growth_bytes: int, available_bytes: int | None = None) -> str | None:
    """None if a compile child fits in memory now, else why not.

    The child builds its own runner, so it holds a second copy of the weights (the prepared copy, or the checkpoint
    itself where the prepared copy has no weights, as for a bf16 GGUF). server_growth_bytes: what the server may
    still take (its KV pool's pages become resident as they fill). A Llama-3.1-8B-shaped bf16 GGUF (13.7 GiB) on a
    24 GiB machine got the server OOM-killed the moment its child had loaded. Compiling in the server instead
    holds both cores and the GIL for minutes (requests then crawl), so the caller serves those buckets eagerly."""
    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    need = weight_bytes + server_growth_bytes + CHILD_OVERHEAD_BYTES
    if available >= need:
        return None
    return (f"a compile child needs {need / 2**30:.1f} GiB (its own {weight_bytes / 2**30:.1f} GiB of weights, the "
            f"server's KV pool still to fill, 1 GiB of its own) and {available / 2**30:.1f} GiB are available")


def child_env() -> dict[str, str]:
    """One compute thread and no inductor compile workers: the child is only ever meant to use idle CPU time."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}  # the flags travel as JSON
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONUNBUFFERED="1")
    return env


class CompileChild:
    """The server's handle on one compile child: the buckets it reports ready, its exit, and stopping it."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        repo = Path(__file__).resolve().parent.parent
        # stdout: the `ready` lines; stderr: the child's log, straight into the server's; stdin: held open, its EOF
        # (our exit, however it happens) ends the child.
        self.proc = subprocess.Popen(cmd, cwd=repo, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=None, text=True)

    @classmethod
    def start(cls, config: EngineConfig, buckets: list[int], artifact_dir: Path) -> CompileChild:
        fields = dataclasses.asdict(config)
        cmd = [sys.executable, "-m", "engine.compile_worker", "--config", json.dumps(fields),
               "--buckets", ",".join(map(str, buckets)), "--artifact-dir", str(artifact_dir)]
        return cls(cmd, child_env())

    @property
    def pid(self) -> int:
        return self.proc.pid

    def finished(self) -> Iterator[tuple[int, float]]:
        """(bucket, compile seconds) as the child saves each one; ends when the child closes its stdout (exits)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = line.split()
            if len(parts) == 3 and parts[0] == READY:
                yield int(parts[1]), float(parts[2])

    def wait(self) -> int:
        return self.proc.wait()

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (a compiling child has nothing to save: it dies at once), SIGKILL after `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        else:
            self.proc.wait()  # reap it
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
