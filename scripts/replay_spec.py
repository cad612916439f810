"""What n-gram speculation would give on a workload, without a server's noise: replay greedy outputs through the
engine's own drafter and planner (engine/speculative.py), with measured step costs per bucket.

    .venv/bin/python scripts/replay_spec.py [--workload edit|extract|free] [--prompts 40] [--clients 1 8]
        [--step-ms 1:5.1,2:6.9,4:9.1,8:11.5,16:20.7,24:30.8,32:35.3] [--outputs FILE]

The greedy outputs of the default model with speculation off (`ember bench`'s edit / extract prompts, built by
server/bench/copy_workloads.py's functions with the model's tokenizer; free: windows of seeded words, as the fixed
workload's, best with --prompt-len 128) are computed once and kept in --outputs.
Then, for each client count, the requests run as a queue of that many at a time: every step the Speculator
proposes and plans drafts for the running ones, each draft is checked against the greedy text (what verification
keeps, since greedy output with drafts equals it without), and the step costs --step-ms of its bucket
(`/get_server_info`'s `speculative.step_ms` from a server that ran the workload). Prints tok/s against the same
queue without drafts, tokens per request-step and rows per step. Prefill is left out (it is the same either way),
so a served ratio is lower by the prefill's share of the run.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from engine.speculative import Speculator
from server.bench.copy_workloads import CODE_GLOBS, DOC_GLOBS, _edit, _extract, _texts
from server.bench.prompts import seeded_piece, windows

DEFAULT_STEP_MS = "1:5.1,2:6.9,4:9.1,8:11.5,16:20.7,24:30.8,32:35.3"  # SmolLM2 Q4_1, AMX Xeon (docs/benchmarks.md)


class Replayed:
    """The fields of an engine Request that the Speculator reads, and the greedy continuation it is checked against."""

    def __init__(self, prompt: list[int], greedy: list[int]) -> None:
        self.prompt_ids, self.greedy, self.output_ids = prompt, greedy, []
        self.max_new_tokens, self.spec, self.matcher, self.pooling = len(greedy), None, None, None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


def greedy_outputs(workload: str, count: int, prompt_len: int, max_tokens: int) -> list[list[list[int]]]:
    """[prompt, greedy output] pairs of the default model with speculation off."""
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.sampling_params import SamplingParams

    core = EngineCore(EngineConfig(speculative="off", max_running_requests=8, decode_buckets=(1, 2, 4, 8),
                                   background_compile=False).resolved())
    rng, prompts = random.Random(0), []
    if workload == "free":  # `ember bench`'s fixed workload: windows of a stream of seeded words
        stream: list[int] = []
        while len(stream) < prompt_len + count:
            stream += core.tokenizer(seeded_piece(rng), add_special_tokens=False)["input_ids"]
        prompts = windows(stream, prompt_len, count, 0)
    else:
        make, pool = (_edit, _texts(CODE_GLOBS)) if workload == "edit" else (_extract, _texts(DOC_GLOBS))
        for _ in range(count):
            head, body, tail = (core.tokenizer(p, add_special_tokens=False)["input_ids"]
                                for p in make(rng, rng.choice(pool), prompt_len * 5))
            prompts.append(head + body[: prompt_len - len(head) - len(tail)] + tail)
    outs = core.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    core.close()
    return [[p, o] for p, o in zip(prompts, outs)]


def replay(pairs: list[list[list[int]]], clients: int, step_ms: dict[int, float], max_draft: int = 7
           ) -> tuple[float, float, float]:
    """(tok/s, tokens per request-step, rows per step) of the queue run `clients` at a time with drafts."""
    buckets = sorted(step_ms)
    spec = Speculator(buckets, lambda b: True, max_draft)
    queue = [Replayed(p, o) for p, o in pairs]
    running: list[Replayed] = []
    seconds, tokens, request_steps, steps, rows_total = 0.0, 0, 0, 0, 0
    while queue or running:
        while queue and len(running) < clients:
            running.append(queue.pop(0))
        drafts = spec.drafts(running, buckets[-1] - len(running))  # type: ignore[arg-type]
        rows = len(running) + sum(len(d) for d in drafts)
        bucket = spec.planner.bucket(rows)
        assert bucket is not None
        step_s = step_ms[bucket] / 1e3
        spec.planner.observe(rows, step_s)
        seconds += step_s
        steps += 1
        rows_total += rows
        request_steps += len(running)
        for req, draft in zip(running, drafts):
            at, kept = len(req.output_ids), 0
            while kept < len(draft) and at + kept < len(req.greedy) and draft[kept] == req.greedy[at + kept]:
                kept += 1
            if draft:
                spec.verified(req, len(draft), kept)  # type: ignore[arg-type]
            new = min(kept + 1, len(req.greedy) - at)
            req.output_ids = req.greedy[: at + new]
            tokens += new
        running = [r for r in running if len(r.output_ids) < len(r.greedy)]
    return tokens / seconds, tokens / request_steps, rows_total / steps


def plain(pairs: list[list[list[int]]], clients: int, step_ms: dict[int, float]) -> float:
    """tok/s of the same queue without drafts: one token a request a step."""
    lengths, seconds = sorted((len(o) for _, o in pairs), reverse=True), 0.0
    buckets = sorted(step_ms)
    for i in range(0, len(lengths), clients):  # waves of `clients` requests (equal lengths here: ignore_eos)
        wave = lengths[i : i + clients]
        seconds += wave[0] * step_ms[next(b for b in buckets if b >= len(wave))] / 1e3
    return sum(lengths) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["edit", "extract", "free"], default="edit")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--clients", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--step-ms", default=DEFAULT_STEP_MS, help="bucket:ms,... (a server's speculative.step_ms)")
    ap.add_argument("--outputs", type=Path, default=None, help="greedy outputs, computed once (default: a temp file)")
    a = ap.parse_args()
    step_ms = {int(b): float(ms) for b, ms in (kv.split(":") for kv in a.step_ms.split(","))}
    path = a.outputs or Path(f"/tmp/ember-replay-{a.workload}-{a.prompts}-{a.prompt_len}-{a.max_tokens}.json")
    if path.exists():
        pairs = json.loads(path.read_text())
    else:
        pairs = greedy_outputs(a.workload, a.prompts, a.prompt_len, a.max_tokens)
        path.write_text(json.dumps(pairs))
    for clients in a.clients:
        tok_s, per_step, rows = replay(pairs, clients, step_ms)
        off = plain(pairs, clients, step_ms)
        print(f"{a.workload}, {clients} clients: {tok_s:.1f} tok/s against {off:.1f} without drafts "
              f"({tok_s / off:.2f}x); {per_step:.2f} tokens a request-step, {rows:.1f} rows a step", flush=True)


if __name__ == "__main__":
    main()
