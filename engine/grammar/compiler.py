"""Compiling grammar specs into llguidance matchers, cached per spec.

Why llguidance (scripts/grammar_libs.py measured it against xgrammar on a 2-core AVX2 EPYC with SmolLM2's
49k vocabulary): a schema compiles in 0.4-0.6 ms (xgrammar 5 ms), so per-request tool schemas cost nothing; its
mask takes ~25 us per row and token (xgrammar ~3-5 us), under 0.1 % of a decode step; it reads JSON schema,
regex, Lark and (converted) GBNF; and it has no dependencies, where xgrammar pulls in triton (1 GB) on a CPU
machine.

Thread safety: `compile` runs on the server's grammar thread, `matcher` on the event loop (via
EngineCore.make_requests); the cache is shared under a lock. Matchers themselves are used by one thread only:
the engine thread, once the request is queued.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
from llguidance.gbnf_to_lark import any_to_lark, gbnf_to_lark
from transformers import PreTrainedTokenizerBase

from engine.grammar.spec import GrammarError, GrammarSpec

CACHE_SIZE = 256
# Fixed separators and no free whitespace: a small model let loose between JSON tokens can emit newlines or
# spaces until max_tokens. These match json.dumps' defaults, the form most JSON in training data has.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def lark_string(text: str) -> str:
    """A Lark string literal matching exactly `text` (Lark takes JSON-style escapes)."""
    return json.dumps(text)


def _prefixed(prefix: str, grammar: str) -> str:
    """`grammar` (Lark text, or llguidance's JSON with its list of grammars) as the grammar named `answer` after
    `prefix`, a Lark grammar that refers to it as `@answer` (llguidance's nested grammars)."""
    if grammar.lstrip().startswith("{"):
        inner = json.loads(grammar)["grammars"]
    else:
        inner = [{"lark_grammar": grammar}]
    inner[0] = {**inner[0], "name": "answer"}
    return json.dumps({"grammars": [{"name": "reasoning", "lark_grammar": prefix}, *inner]})


class GrammarCompiler:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._hf, self.vocab_size, self._eos = tokenizer, vocab_size, list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use: ~0.5 s for a 49k vocabulary
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                               eos_token=self._eos or None)
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """The spec's matcher in its start state (the cached template: never advance it; see `matcher`).
        Raises GrammarError with llguidance's message for a bad schema, regex or grammar."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        template = self._build(spec)
        with self._lock:
            self._cache[spec] = template
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return template

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence (a copy of the cached template: copying is cheap, building is not)."""
        return self.compile(spec).deep_copy()

    def cached(self) -> int:
        with self._lock:
            return len(self._cache)

    def _build(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        grammar = self._grammar_text(spec)
        if spec.prefix is not None:
            grammar = _prefixed(spec.prefix, grammar)
        # The constructor never raises for grammar errors: it leaves the matcher in an error state.
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"{spec.param}: {m.get_error()}", spec.param)
        return m

    def _grammar_text(self, spec: GrammarSpec) -> str:
        try:
            if spec.kind == "json_schema":
                options = {**JSON_OPTIONS, "lenient": not spec.strict}
                return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=options)
            if spec.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(spec.source)
            if spec.kind == "choice":
                options = json.loads(spec.source)
                return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(lark_string, options)))
            if spec.kind == "lark":
                return llguidance.LLMatcher.grammar_from_lark(spec.source)
            if spec.kind == "ebnf":  # GBNF, llama.cpp's and SGLang's EBNF dialect
                return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.source))
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.source))  # "grammar": Lark or GBNF
        except GrammarError:
            raise
        except Exception as exc:  # the converters raise ValueError and friends for malformed input
            raise GrammarError(f"{spec.param}: {exc}", spec.param) from exc
