"""A grammar with a reasoning prefix (GrammarSpec.prefix, built by server/api/reasoning.py): free text up to and
including `</think>`, then the original constraint, for every kind of spec. Checked on llguidance matchers over
the tiny byte-level tokenizer, token by token, so a tag split across tokens is covered too."""
from __future__ import annotations

from dataclasses import replace

import pytest

from engine.grammar.compiler import GrammarCompiler
from engine.grammar.spec import GrammarSpec
from server.api.reasoning import Start, grammar_prefix
from tiny_models import tiny_tokenizer

SPECS = {
    "json_schema": (GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                             "required": ["a"]}), '{"a": 12}', "Paris"),
    "regex": (GrammarSpec("regex", "Paris|Rome"), "Paris", "Lyon"),
    "choice": (GrammarSpec.choice(["yes", "no"]), "no", "maybe"),
    "lark": (GrammarSpec("lark", 'start: "call(" /[0-9]+/ ")"'), "call(42)", "call(x)"),
}


TOKENIZER = tiny_tokenizer()


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(TOKENIZER, len(TOKENIZER), (TOKENIZER.eos_token_id,))


def _accepts(compiler: GrammarCompiler, spec: GrammarSpec, text: str) -> bool:
    """The whole text is allowed and may end there."""
    matcher = compiler.matcher(spec)
    for token in TOKENIZER.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_prompt_opened_block_reasoning_then_the_answer(compiler: GrammarCompiler, kind: str) -> None:
    spec, good, bad = SPECS[kind]
    wrapped = replace(spec, prefix=grammar_prefix(Start.REASONING))
    assert _accepts(compiler, wrapped, f"first {bad}, then <think> and </thin... done</think>\n\n{good}")
    assert not _accepts(compiler, wrapped, f"thinking</think>\n\n{bad}")  # the answer is still constrained
    assert not _accepts(compiler, wrapped, good)  # no answer before the reasoning ends


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_output_may_open_the_block_or_answer_at_once(compiler: GrammarCompiler, kind: str) -> None:
    spec, good, bad = SPECS[kind]
    wrapped = replace(spec, prefix=grammar_prefix(Start.MAYBE))
    assert _accepts(compiler, wrapped, f"<think>\nweighing {bad}\n</think>\n\n{good}")
    assert _accepts(compiler, wrapped, good)
    assert not _accepts(compiler, wrapped, bad)
    assert compiler.compile(wrapped) is not compiler.compile(spec)  # the prefix is part of the cache key
