"""Peak resident memory and CPU time of a server's process tree, sampled while `ember bench` runs.

RSS is summed over the process and all its descendants (vLLM serves from a child process; llama-server and
Ember from one). Pages shared between processes count once per process, so a multi-process server's sum
overstates what it holds; that is what `ps` and most comparisons report.

The machine-level CPU counters tell whether anything else was busy: on a 2-core box one foreign busy thread
halves a server's throughput, so every report says how much CPU went to neither the server nor this client.
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import psutil

SAMPLE_SECONDS = 0.1


def _busy_cpu_seconds() -> float:
    """Machine-wide CPU seconds spent not idle (all cores)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _own_cpu_seconds() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


@dataclass
class TreeSample:
    rss_bytes: int
    cpu_seconds: dict[int, float] = field(default_factory=dict)  # pid -> user + system, of live processes


def sample_tree(root: psutil.Process) -> TreeSample:
    """RSS and CPU of `root` and its descendants now; processes that exit meanwhile are skipped."""
    sample = TreeSample(0)
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return sample
    for p in procs:
        try:
            with p.oneshot():
                sample.rss_bytes += p.memory_info().rss
                t = p.cpu_times()
                sample.cpu_seconds[p.pid] = t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return sample


class ServerMonitor:
    """Samples a process tree every SAMPLE_SECONDS from a background task, between `start()` and `stop()`.

    `pid=None` monitors no server: only the machine's and this client's CPU are measured.
    """

    def __init__(self, pid: int | None) -> None:
        self._root = psutil.Process(pid) if pid is not None else None  # raises NoSuchProcess for a bad pid
        self.peak_rss_bytes = 0
        self.samples = 0
        self._cpu_first: dict[int, float] = {}
        self._cpu_last: dict[int, float] = {}
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._busy0 = self._own0 = 0.0
        self.busy_cpu_seconds = self.client_cpu_seconds = 0.0

    def _sample(self) -> None:
        if self._root is None:
            return
        s = sample_tree(self._root)
        self.samples += 1
        self.peak_rss_bytes = max(self.peak_rss_bytes, s.rss_bytes)
        for pid, cpu in s.cpu_seconds.items():
            self._cpu_first.setdefault(pid, cpu)
            self._cpu_last[pid] = cpu

    async def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            # The wait is the sampling period; stop() ends it at once.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), SAMPLE_SECONDS)

    def start(self) -> None:
        self._busy0, self._own0 = _busy_cpu_seconds(), _own_cpu_seconds()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
        self._sample()  # one last reading, so a run shorter than a period still has one
        self.busy_cpu_seconds = _busy_cpu_seconds() - self._busy0
        self.client_cpu_seconds = _own_cpu_seconds() - self._own0

    @property
    def server_cpu_seconds(self) -> float:
        """CPU the server tree used while monitored (processes that exited before the last sample are lost)."""
        return sum(self._cpu_last[p] - self._cpu_first[p] for p in self._cpu_last)

    @property
    def other_cpu_seconds(self) -> float:
        """CPU spent by neither the server nor this client: other users of the machine (never below 0)."""
        return max(0.0, self.busy_cpu_seconds - self.server_cpu_seconds - self.client_cpu_seconds)
