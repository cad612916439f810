"""Prompts whose answers are mostly copied from the prompt, for `ember bench --workload edit|extract`: where
speculative decoding by prompt lookup pays (engine/speculative.py), next to the `fixed` workload's free text.

- edit: a window of this repository's Python source, then "the same code with one name changed", and the
  opening of a code block: a model continues by rewriting the code, nearly a copy.
- extract: a window of this repository's docs, then a request to quote the passage about a phrase taken from
  it, and an opening quote: the answer is a quotation.

Plain completion prompts (no chat template), so every server gets the same token ids: the text is tokenized
by the server's own tokenize endpoint (server/bench/prompts.py), in three pieces whose ids are concatenated.
The repository's files are fixed for a commit, so the prompts are the same for every server and run.
"""
from __future__ import annotations

import random
import re
from pathlib import Path

import httpx

from server.bench.prompts import PromptError, Tokenizer, find_tokenizer, tokenize

REPO = Path(__file__).resolve().parents[2]
CODE_GLOBS = ("engine/*.py", "server/api/*.py")
DOC_GLOBS = ("docs/*.md",)


def _texts(globs: tuple[str, ...]) -> list[str]:
    files = sorted(p for g in globs for p in REPO.glob(g))
    return [t for t in (p.read_text() for p in files) if len(t) > 2000]


def _edit(rng: random.Random, source: str, chars: int) -> tuple[str, str, str]:
    start = rng.randrange(max(len(source) - chars, 1))
    start = source.rfind("\n", 0, start) + 1
    code = source[start : start + chars]
    names = sorted(set(re.findall(r"\b[a-z_][a-z0-9_]{5,}\b", code))) or ["value"]
    old = rng.choice(names)
    head = "Here is a piece of Python code.\n\n```python\n"
    tail = f"\n```\n\nThe same code with `{old}` renamed to `{old}_new`, and nothing else changed:\n\n```python\n"
    return head, code, tail


def _extract(rng: random.Random, doc: str, chars: int) -> tuple[str, str, str]:
    start = rng.randrange(max(len(doc) - chars, 1))
    start = doc.rfind("\n", 0, start) + 1
    text = doc[start : start + chars]
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) >= 8] or [text[:200]]
    phrase = " ".join(rng.choice(sentences).split()[:4])
    head = "Read this document.\n\n"
    tail = f"\n\nQuote, word for word, the passage of the document that contains \"{phrase}\".\n\nQuote: \""
    return head, text, tail


async def copy_prompts(client: httpx.AsyncClient, model: str | None, kind: str, prompt_len: int, count: int,
                       seed: int) -> tuple[list[list[int]], str]:
    """`count` prompts of at most `prompt_len` ids (the middle piece is cut to fit), and the tokenizer's path."""
    tok: Tokenizer | None = await find_tokenizer(client, model)
    if tok is None:
        raise PromptError("the edit and extract workloads need the server's tokenize endpoint")
    make, pool = (_edit, _texts(CODE_GLOBS)) if kind == "edit" else (_extract, _texts(DOC_GLOBS))
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for _ in range(count):
        # ~4 characters a token: enough text for the window, which is then cut to prompt_len in ids
        pieces = make(rng, rng.choice(pool), prompt_len * 5)
        ids = [await tokenize(client, tok, model, piece) for piece in pieces]
        if any(i is None for i in ids):
            raise PromptError(f"{tok.path} stopped answering while building prompts")
        head, body, tail = ids  # type: ignore[misc]
        room = prompt_len - len(head) - len(tail)
        if room < 16:
            raise ValueError(f"--prompt-len {prompt_len} leaves no room for the {kind} workload's text")
        prompts.append([*head, *body[:room], *tail])
    return prompts, f"{tok.path}:{tok.body_key}"
