"""Structured-output cost on a running server: decode tokens/s of N concurrent streaming chat clients whose
responses are constrained by a JSON schema, against N unconstrained clients, in alternating rounds, plus the
per-step mask cost read from Ember's /metrics (ember:grammar_mask_seconds / ember:grammar_masked_rows).

    ember serve --port 8000 &   # any model
    .venv/bin/python scripts/bench_structured.py --base-url http://127.0.0.1:8000 [--clients 8 --rounds 2]

Both kinds produce exactly --max-tokens tokens (the schema asks for more array items than fit; the free
clients send ignore_eos), so the two runs decode the same number of tokens from the same prompts.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

SCHEMA = {  # a list of records: long enough that no response completes within max_tokens
    "type": "object",
    "properties": {"people": {"type": "array", "minItems": 40, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 120},
                       "city": {"type": "string", "maxLength": 24},
                       "role": {"enum": ["engineer", "doctor", "teacher", "artist"]}},
        "required": ["name", "age", "city", "role"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False,
}


async def _client(http: httpx.AsyncClient, k: int, max_tokens: int, constrained: bool) -> tuple[int, float, float]:
    """(tokens, first-token time, last-token time) of one streamed chat completion."""
    body: dict = {"messages": [{"role": "user", "content": f"List {40 + k} people as JSON: name, age, city, role."}],
                  "max_tokens": max_tokens, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    first = last = 0.0
    tokens = 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
    return tokens, first, last


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rpartition(" ")[2])
    return total


async def _round(http: httpx.AsyncClient, clients: int, max_tokens: int, constrained: bool) -> dict[str, float]:
    before = (await http.get("/metrics")).text
    t0 = time.perf_counter()
    runs = await asyncio.gather(*(_client(http, k, max_tokens, constrained) for k in range(clients)))
    after = (await http.get("/metrics")).text
    tokens = sum(r[0] for r in runs)
    # Decode rate: tokens after each client's first, over the span from the first first-token to the last token.
    span = max(r[2] for r in runs) - min(r[1] for r in runs)
    delta = {n: _metric(after, n) - _metric(before, n)
             for n in ("ember:grammar_mask_seconds", "ember:grammar_masked_rows", "ember:decode_steps")}
    return {"tokens": tokens, "wall_s": time.perf_counter() - t0, "decode_tok_s": (tokens - clients) / span,
            "mask_ms_per_step": 1e3 * delta["ember:grammar_mask_seconds"] / max(delta["ember:decode_steps"], 1),
            "mask_us_per_row": 1e6 * delta["ember:grammar_mask_seconds"] / max(delta["ember:grammar_masked_rows"], 1),
            "decode_steps": delta["ember:decode_steps"]}


async def main_async(args: argparse.Namespace) -> None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 2)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=600, limits=limits) as http:
        await _round(http, args.clients, 8, True)  # warm-up: compiles the schema, fills caches
        rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for constrained in (False, True):
                r = await _round(http, args.clients, args.max_tokens, constrained)
                rows[constrained].append(r)
                print(f"{'json_schema' if constrained else 'free':12} tokens {r['tokens']:5.0f}  decode "
                      f"{r['decode_tok_s']:6.1f} tok/s  mask {r['mask_ms_per_step']:.3f} ms/step "
                      f"({r['mask_us_per_row']:.0f} us/row)", flush=True)
    free = statistics.median(r["decode_tok_s"] for r in rows[False])
    constrained = statistics.median(r["decode_tok_s"] for r in rows[True])
    mask = statistics.median(r["mask_ms_per_step"] for r in rows[True])
    per_row = statistics.median(r["mask_us_per_row"] for r in rows[True])
    print(f"\n{args.clients} clients, {args.max_tokens} tokens each, median of {args.rounds} rounds:")
    print(f"  free        {free:7.1f} tok/s")
    print(f"  json_schema {constrained:7.1f} tok/s  ratio {constrained / free:.3f}")
    print(f"  mask cost   {mask:.3f} ms per decode step, {per_row:.0f} us per constrained row")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
