"""Prompts of exactly P tokens for `ember bench`, the same for every server given the same seed and tokenizer.

The prompts are sent as token-id lists, which Ember, vLLM and llama-server all accept as a /v1/completions
`prompt`: a list of ids is used as it is (no BOS added, no re-tokenization), so every server prefills exactly
P tokens. The ids come from the server's own tokenizer applied to seeded pseudo-English text, so they are
ordinary tokens of the model; each prompt is a window at a distinct offset of that token stream, so no two
prompts share a prefix and no server gains from prefix caching.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import httpx

_WORDS = (
    "the of and to in is was for on that with as by at from his her they which this be are an or had not but "
    "all were when we there can more one about other into time has some what their would only like them up "
    "out these so first people years after over new two most many where way could also made well through work "
    "city river house music water light story field market school winter garden number system history paper "
    "bridge forest island letter machine mountain station village window morning evening engine signal "
    "memory planet ocean season silver stone summer theory thunder valley weather yellow quickly slowly "
    "carefully gently loudly quietly bright dark warm cold ancient modern simple strange small large"
).split()
_WORDS_PER_PIECE = 400  # one /tokenize call: ~500 tokens, below any server's context limit


class PromptError(RuntimeError):
    """The prompts cannot be built: no tokenize endpoint answered and no --vocab-size was given."""


@dataclass(frozen=True)
class Tokenizer:
    """How one server tokenizes: the endpoint and the body it takes."""

    path: str
    body_key: str  # "prompt" (Ember, vLLM) or "content" (llama-server)


# Ember: /v1/tokenize; vLLM: /tokenize (same body); llama-server: /tokenize {"content"} (its answer to a body
# without "content" is an empty list, which is why emptiness means "try the next one").
TOKENIZERS = (Tokenizer("/v1/tokenize", "prompt"), Tokenizer("/tokenize", "prompt"), Tokenizer("/tokenize", "content"))


def seeded_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def seeded_piece(rng: random.Random) -> str:
    """One piece of the fixed workload's text, as one tokenize call takes it."""
    return " " + seeded_text(rng, _WORDS_PER_PIECE)


async def tokenize(client: httpx.AsyncClient, tok: Tokenizer, model: str | None, text: str) -> list[int] | None:
    body: dict[str, Any] = {tok.body_key: text}
    if tok.body_key == "prompt":
        body.update(model=model, add_special_tokens=False)
    try:
        resp = await client.post(tok.path, json=body)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        tokens = resp.json().get("tokens")
    except ValueError:
        return None
    if not tokens or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        return None
    return list(tokens)


async def find_tokenizer(client: httpx.AsyncClient, model: str | None) -> Tokenizer | None:
    """The first endpoint of TOKENIZERS that turns a sentence into a non-empty list of ids."""
    for tok in TOKENIZERS:
        if await tokenize(client, tok, model, "The quick brown fox jumps over the lazy dog.") is not None:
            return tok
    return None


async def token_stream(client: httpx.AsyncClient, tok: Tokenizer, model: str | None, seed: int,
                       length: int) -> list[int]:
    """At least `length` ids: seeded text tokenized piece by piece (each piece well within any context)."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < length:
        piece = await tokenize(client, tok, model, seeded_piece(rng))
        if piece is None:
            raise PromptError(f"{tok.path} stopped answering while building prompts")
        ids.extend(piece)
    return ids


def windows(stream: list[int], prompt_len: int, count: int, seed: int) -> list[list[int]]:
    """`count` windows of `prompt_len` ids at distinct offsets of `stream`, in a seeded order."""
    offsets = random.Random(seed).sample(range(len(stream) - prompt_len + 1), count)
    return [stream[o:o + prompt_len] for o in offsets]


def random_prompts(vocab_size: int, prompt_len: int, count: int, seed: int) -> list[list[int]]:
    """Fallback for a server without a tokenize endpoint: uniform ids below `vocab_size` (a model's special
    tokens are among them, which changes nothing for the compute of a prefill)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(prompt_len)] for _ in range(count)]


async def build_prompts(client: httpx.AsyncClient, model: str | None, prompt_len: int, count: int, seed: int,
                        vocab_size: int | None) -> tuple[list[list[int]], str]:
    """(`count` prompts of exactly `prompt_len` ids, where the ids came from: the endpoint path or "random")."""
    if prompt_len < 1 or count < 1:
        raise ValueError("prompt length and prompt count must be positive")
    tok = await find_tokenizer(client, model)
    if tok is None:
        if vocab_size is None:
            raise PromptError("the server has no tokenize endpoint (/v1/tokenize or /tokenize); "
                              "pass --vocab-size to send seeded random token ids instead")
        return random_prompts(vocab_size, prompt_len, count, seed), "random"
    # prompt_len + count - 1 ids are enough for `count` distinct offsets; the rest is slack.
    stream = await token_stream(client, tok, model, seed, prompt_len + count)
    return windows(stream, prompt_len, count, seed), f"{tok.path}:{tok.body_key}"
