"""Reasoning read out of a chat output: the `<think>...</think>` convention of DeepSeek-R1 distills and Qwen3.

Which parser: `--reasoning-parser deepseek_r1|qwen3|none`, or by default any chat template that mentions
`<think>`. Both conventions share one parser; they differ only in where the output starts, which is read from the
rendered prompt, not from the parser's name:

- the prompt ends inside an open think block (R1 distills' `<｜Assistant｜><think>\\n`, Qwen3 thinking templates):
  the output starts in the reasoning, with no opening tag (`Start.REASONING`);
- the prompt closed the block (Qwen3 with `enable_thinking: false` renders `<think>\\n\\n</think>\\n\\n`): there is
  no reasoning, the output is the answer (`Start.ANSWER`);
- otherwise the output may open a think block itself, as its first non-blank text (`Start.MAYBE`).

The answer is what follows `</think>`, leading whitespace dropped. An output cut off inside its reasoning has
reasoning and no answer. `ReasoningParser.split` is exactly `feed` over any chunking plus `finish`: the
incremental form holds back text that may be the start of a tag, so a tag split across tokens is never leaked.
"""
from __future__ import annotations

import enum
import json

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


class Start(enum.Enum):
    MAYBE = "maybe"  # the output may open a think block
    REASONING = "reasoning"  # the prompt opened the block
    ANSWER = "answer"  # the prompt closed it (or there is no reasoning)


def parser_for_template(chat_template: str | dict[str, str] | None, override: str | None) -> str | None:
    """The parser's name: `override` ("none" turns it off) or, by default, one for a template mentioning
    `<think>`. None: no reasoning parser."""
    if override is not None:
        return None if override == "none" else override
    text = json.dumps(chat_template) if isinstance(chat_template, dict) else (chat_template or "")
    if OPEN not in text:
        return None
    return "deepseek_r1" if "｜Assistant｜" in text else "qwen3"


def prompt_start(prompt_text: str) -> Start:
    """Where the output starts, from the rendered prompt's tail (see the module docstring)."""
    opened, closed = prompt_text.rfind(OPEN), prompt_text.rfind(CLOSE)
    if opened > closed:
        return Start.REASONING
    if closed >= 0 and prompt_text.rstrip().endswith(CLOSE):
        return Start.ANSWER
    return Start.MAYBE


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (text that may become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """One choice's output as (reasoning, answer), whole (`split`) or incrementally (`feed`, then `finish`)."""

    def __init__(self, start: Start = Start.MAYBE) -> None:
        self._state = {Start.MAYBE: "lead", Start.REASONING: "reasoning", Start.ANSWER: "answer_lead"}[start]
        self._held = ""  # text not yet decided: a possible tag, or leading whitespace

    def feed(self, delta: str, last: bool = False) -> tuple[str, str]:
        """(reasoning delta, answer delta) for new output text; `last`: the output ends here, so nothing is held
        back (what `finish` releases is included)."""
        if last:
            r1, a1 = self.feed(delta)
            r2, a2 = self.finish()
            return r1 + r2, a1 + a2
        reasoning, answer = [], []
        text, self._held = self._held + delta, ""
        while text:
            if self._state == "lead":  # before any non-blank text: it may open a think block
                stripped = text.lstrip()
                if stripped.startswith(OPEN):
                    text, self._state = stripped[len(OPEN):], "reasoning"
                elif OPEN.startswith(stripped):  # blank, or a prefix of the tag: undecided
                    self._held = text
                    break
                else:
                    self._state = "answer_lead"
            elif self._state == "reasoning":
                end = text.find(CLOSE)
                if end >= 0:
                    reasoning.append(text[:end])
                    text, self._state = text[end + len(CLOSE):], "answer_lead"
                    continue
                keep = _partial_tail(text, CLOSE)
                reasoning.append(text[:len(text) - keep])
                self._held = text[len(text) - keep:]
                break
            elif self._state == "answer_lead":  # whitespace between </think> and the answer is dropped
                text = text.lstrip()
                if text:
                    self._state = "answer"
            else:
                answer.append(text)
                break
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the output: a partial tag inside reasoning stays reasoning."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held, ""
        if self._state == "lead":
            return "", held.lstrip()
        return "", held

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of a whole output."""
        return self.feed(text, last=True)


def grammar_prefix(start: Start) -> str | None:
    """The Lark rule that lets the reasoning run free before a constrained answer (engine/grammar/compiler.py
    wraps the answer's grammar with it); None: the answer starts at once."""
    if start is Start.ANSWER:
        return None
    think = 'think[lazy]: /(?s:.*)<\\/think>/'
    blank = '/[ \\t\\r\\n]*/'
    if start is Start.REASONING:
        return f"start: think {blank} @answer\n{think}\n"
    return f'start: {blank} ("<think>" think {blank})? @answer\n{think}\n'
