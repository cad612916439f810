"""Measure xgrammar against llguidance on this machine, with SmolLM2's tokenizer: tokenizer setup, grammar
compile time per schema, and the per-token mask cost while walking a valid output.

    .venv/bin/python scripts/grammar_libs.py [--model PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMAS: dict[str, dict] = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {
                "name": {"type": "string"}, "role": {"enum": ["admin", "user", "guest"]},
                "score": {"type": "number", "minimum": 0, "maximum": 100}},
                "required": ["name", "role", "score"], "additionalProperties": False},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "active": {"type": "boolean"},
        },
        "required": ["user", "tags", "active"], "additionalProperties": False,
    },
}
SAMPLES = {
    "flat": {"name": "Ada Lovelace", "age": 36},
    "nested": {"user": {"name": "Grace", "role": "admin", "score": 97.5}, "tags": ["navy", "cobol", "compilers"],
               "active": True},
}


def _ms(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def bench_xgrammar(tok, vocab: int) -> dict[str, float]:
    import xgrammar as xgr
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    out["tokenizer_ms"] = (time.perf_counter() - t0) * 1e3
    for name, schema in SCHEMAS.items():
        text = json.dumps(schema)
        out[f"compile_{name}_ms"] = _ms(lambda: xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(text))
        compiled = xgr.GrammarCompiler(info).compile_json_schema(text)
        ids = tok.encode(json.dumps(SAMPLES[name]), add_special_tokens=False)
        m = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, vocab)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - t0)
            assert m.accept_token(t), f"xgrammar rejected token {t}"
        out[f"mask_{name}_us_median"] = statistics.median(times) * 1e6
        out[f"mask_{name}_us_max"] = max(times) * 1e6
    out["compile_any_json_ms"] = _ms(lambda: xgr.GrammarCompiler(info, cache_enabled=False).compile_builtin_json_grammar())
    out["compile_regex_ms"] = _ms(lambda: xgr.GrammarCompiler(info, cache_enabled=False).compile_regex(r"\d{3}-\d{4}"))
    logits = torch.randn(8, vocab)
    mask = xgr.allocate_token_bitmask(8, vocab)
    out["apply_b8_us"] = _ms(lambda: xgr.apply_token_bitmask_inplace(logits, mask), 20) * 1e3
    return out


def bench_llguidance(tok, vocab: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    out["tokenizer_ms"] = (time.perf_counter() - t0) * 1e3
    for name, schema in SCHEMAS.items():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        out[f"compile_{name}_ms"] = _ms(lambda: llguidance.LLMatcher(lltok, grammar))
        ids = tok.encode(json.dumps(SAMPLES[name]), add_special_tokens=False)
        m = llguidance.LLMatcher(lltok, grammar)
        mask = lt.allocate_token_bitmask(1, vocab)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask(m, mask, 0)
            times.append(time.perf_counter() - t0)
            assert m.consume_token(t), f"llguidance rejected token {t}: {m.get_error()}"
        out[f"mask_{name}_us_median"] = statistics.median(times) * 1e6
        out[f"mask_{name}_us_max"] = max(times) * 1e6
    anyjson = llguidance.LLMatcher.grammar_from_json_schema({})
    out["compile_any_json_ms"] = _ms(lambda: llguidance.LLMatcher(lltok, anyjson))
    rx = llguidance.LLMatcher.grammar_from_regex(r"\d{3}-\d{4}")
    out["compile_regex_ms"] = _ms(lambda: llguidance.LLMatcher(lltok, rx))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2 GGUF)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from engine.loader import load_tokenizer
    tok = load_tokenizer(args.model)
    vocab = len(tok)
    rows = {"xgrammar": bench_xgrammar(tok, vocab), "llguidance": bench_llguidance(tok, vocab)}
    keys = sorted(set().union(*rows.values()))
    print(f"{'measure':28} {'xgrammar':>12} {'llguidance':>12}")
    for k in keys:
        print(f"{k:28} " + " ".join(f"{rows[n].get(k, float('nan')):12.1f}" for n in rows))


if __name__ == "__main__":
    main()
