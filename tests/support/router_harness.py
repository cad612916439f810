"""Several `ember serve` replicas behind a real smg (Shepherd Model Gateway) router, for the scale-out tests and the
soak script (scripts/soak.py).

Every replica is a real server on its own loopback port (server_harness.start_server); smg is the pinned PyPI
binary, started with its worker URLs and a fast health check so a killed replica is noticed within seconds. The
per-replica request counts come from each replica's own /metrics, never from the router, so a routing claim is
checked against what the workers really served.
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from server_harness import API_KEY, Server, free_port, metrics, start_server, stop_server, wait_for_health

SMG = Path(sys.executable).with_name("smg")
HEALTH_INTERVAL_S = 1
ROUTER_FLAGS = ["--health-check-interval-secs", str(HEALTH_INTERVAL_S), "--health-failure-threshold", "2",
                "--health-success-threshold", "1", "--health-check-timeout-secs", "2", "--retry-max-retries", "4",
                "--retry-initial-backoff-ms", "100", "--worker-startup-timeout-secs", "120", "--log-level", "info"]


def smg_binary() -> Path:
    found = SMG if SMG.is_file() else shutil.which("smg")
    if not found:
        raise RuntimeError("the smg router is not installed (pip install -e '.[test]' installs the pinned one)")
    return Path(found)


@dataclass
class Replica:
    index: int
    args: list[str]
    log_path: Path
    port: int
    server: Server

    @property
    def url(self) -> str:
        return self.server.base_url

    def restart(self) -> None:
        """Start it again on the same port (after a kill or a drain) and wait until it is ready."""
        assert self.server.proc.poll() is not None, "restart of a replica that still runs"
        self.server = start_server(self.args, self.log_path, self.port)
        wait_for_health(self.server)

    def served(self) -> float:
        """Requests this replica finished (every finish reason), from its own /metrics."""
        return sum(v for k, v in metrics(self.server).items() if k.startswith("ember:request_success_total"))


@dataclass
class Cluster:
    replicas: list[Replica]
    router: subprocess.Popen[bytes]
    base_url: str
    router_log: Path
    extra: dict[str, Any] = field(default_factory=dict)

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=timeout)

    def workers(self) -> dict[str, dict[str, Any]]:
        """smg's view of its workers, by URL."""
        with self.client(10) as c:
            return {w["url"]: w for w in c.get("/workers").json()["workers"]}

    def wait_worker(self, url: str, healthy: bool, timeout: float = 30.0) -> float:
        """Seconds until smg reports the worker at `url` healthy (or not); bounded poll of another process."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            w = self.workers().get(url)
            if w is not None and bool(w["is_healthy"]) == healthy:
                return time.monotonic() - t0
            time.sleep(0.2)
        raise AssertionError(f"smg did not mark {url} {'healthy' if healthy else 'unhealthy'} in {timeout} s: "
                             f"{self.workers().get(url)}")

    def served(self) -> list[float]:
        return [r.served() for r in self.replicas]

    def log(self) -> str:
        return self.router_log.read_text(errors="replace")


def start_cluster(n: int, server_args: Callable[[int], list[str]], log_dir: Path, policy: str = "cache_aware",
                  router_flags: list[str] | None = None) -> Cluster:
    """n replicas (ready) and smg in front of them (ready: all workers healthy)."""
    replicas = []
    for i in range(n):  # start all, then wait: they load in parallel
        port = free_port()
        args = server_args(i)
        replicas.append(Replica(i, args, log_dir / f"replica{i}.log", port,
                                start_server(args, log_dir / f"replica{i}.log", port)))
    for r in replicas:
        wait_for_health(r.server)
    port = free_port()
    log = log_dir / "router.log"
    cmd = [str(smg_binary()), "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--api-key", API_KEY, "--worker-urls", *[r.url for r in replicas], *ROUTER_FLAGS,
           # its metrics server would bind 0.0.0.0:29000, shared by every router on the machine
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *(router_flags or [])]
    with open(log, "wb") as f:
        router = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    cluster = Cluster(replicas, router, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + 60
    while True:
        if router.poll() is not None:
            raise RuntimeError(f"smg exited with {router.returncode}:\n{cluster.log()[-3000:]}")
        try:
            workers = cluster.workers()
            if len(workers) == n and all(w["is_healthy"] for w in workers.values()):
                return cluster
        except (httpx.TransportError, ValueError, KeyError):
            pass  # not listening (or not registered) yet
        if time.monotonic() > deadline:
            raise TimeoutError(f"smg not ready with {n} healthy workers:\n{cluster.log()[-3000:]}")
        time.sleep(0.2)


def stop_cluster(cluster: Cluster) -> None:
    if cluster.router.poll() is None:
        cluster.router.send_signal(signal.SIGINT)  # SIGTERM waits out smg's 5 s load-balancer settle window
        try:
            cluster.router.wait(15)
        except subprocess.TimeoutExpired:
            cluster.router.kill()
            cluster.router.wait()
    for r in cluster.replicas:
        stop_server(r.server)
