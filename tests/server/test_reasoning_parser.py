"""The <think> parser (server/api/reasoning.py) on its own: where an output starts, the whole-text split, and the
incremental form at every split point of a text (a tag cut anywhere, even one character at a time)."""
from __future__ import annotations

import pytest

from server.api.reasoning import ReasoningParser, Start, grammar_prefix, parser_for_template, prompt_start

R1_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>\n"
QWEN3_THINKING_OFF = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

CASES: list[tuple[Start, str, tuple[str, str]]] = [
    (Start.REASONING, "step one </think>\n\nParis", ("step one ", "Paris")),
    (Start.REASONING, "no end < /think> still thinking </thin", ("no end < /think> still thinking </thin", "")),
    (Start.REASONING, "</think>", ("", "")),
    (Start.MAYBE, "<think>\nhmm</think>\n\nThe answer", ("\nhmm", "The answer")),
    (Start.MAYBE, "  <think>a<b</think>c</think>", ("a<b", "c</think>")),
    (Start.MAYBE, "plain answer <think>x</think>", ("", "plain answer <think>x</think>")),
    (Start.MAYBE, "<thin", ("", "<thin")),
    (Start.MAYBE, "<think>cut off", ("cut off", "")),
    (Start.ANSWER, "\n answer <think>", ("", "answer <think>")),
]


@pytest.mark.parametrize(("start", "text", "expected"), CASES)
def test_split(start: Start, text: str, expected: tuple[str, str]) -> None:
    assert ReasoningParser(start).split(text) == expected


def _fed(start: Start, pieces: list[str]) -> tuple[str, str]:
    parser, reasoning, answer = ReasoningParser(start), "", ""
    for piece in pieces:
        r, a = parser.feed(piece)
        reasoning, answer = reasoning + r, answer + a
    r, a = parser.finish()
    return reasoning + r, answer + a


@pytest.mark.parametrize(("start", "text", "expected"), CASES)
def test_incremental_matches_split_at_every_boundary(start: Start, text: str, expected: tuple[str, str]) -> None:
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert _fed(start, [text[:i], text[i:j], text[j:]]) == expected, (i, j)
    assert _fed(start, list(text)) == expected  # one character per delta


def test_no_tag_text_leaks_into_a_stream() -> None:
    """No delta ever holds part of a tag: "</thi" is held back until it is known not to be "</think>"."""
    parser = ReasoningParser(Start.REASONING)
    seen = [parser.feed(c) for c in "ab</think>cd"]
    assert all("<" not in r and "<" not in a for r, a in seen)
    assert "".join(r for r, _ in seen) == "ab" and "".join(a for _, a in seen) == "cd"


def test_prompt_start() -> None:
    assert prompt_start(R1_PROMPT) is Start.REASONING
    assert prompt_start(QWEN3_THINKING_OFF) is Start.ANSWER
    assert prompt_start(QWEN3_PROMPT) is Start.MAYBE
    # an earlier turn's closed block does not open the new one
    assert prompt_start("<think>x</think>y<|im_start|>assistant\n") is Start.MAYBE


def test_parser_choice() -> None:
    assert parser_for_template("{{ '<｜Assistant｜><think>\\n' }}", None) == "deepseek_r1"
    assert parser_for_template("{% if enable_thinking is false %}<think>\n\n</think>{% endif %}", None) == "qwen3"
    assert parser_for_template("<|im_start|>assistant\n", None) is None
    assert parser_for_template("<|im_start|>assistant\n", "qwen3") == "qwen3"
    assert parser_for_template("<think>", "none") is None
    assert grammar_prefix(Start.ANSWER) is None
    assert "@answer" in (grammar_prefix(Start.REASONING) or "")
