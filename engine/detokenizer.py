"""Incremental detokenization of one output stream (the prefix / read-offset technique of TGI and vLLM).

Decoding each new token on its own is wrong twice over: a byte-level BPE token can hold part of a multi-byte
UTF-8 character (decoding it alone gives U+FFFD), and SentencePiece decoders strip the leading space of the
first token of every decode call ("▁world" alone is "world"). So every step decodes a short window that starts
a few tokens back (`prefix_offset`) and emits only what the new tokens added beyond the window's already-emitted
part (`read_offset`). Text ending in U+FFFD is held back until the character completes.
"""
from __future__ import annotations

from typing import Protocol

# How many prompt tokens of left context the first window gets (vLLM uses the same 5).
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    """What we need of a tokenizer: a transformers tokenizer or a raw `tokenizers.Tokenizer` both fit."""

    def decode(self, ids: list[int], /, skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas.

    Invariant: `tokens[prefix_offset:read_offset]` decodes to text that has already been emitted (or, at the
    start, belongs to the prompt), and everything from `read_offset` on has not been emitted yet.
    The concatenation of all `push` results and `flush` equals the output decoded in the context of the
    prompt; for byte-level BPE (SmolLM2, GPT-2, Llama 3) that is exactly `decode(output_ids)`, for SentencePiece
    it keeps the leading space of the first output token, as a streaming client expects.
    """

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._tokens: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._tokens[start:end], skip_special_tokens=self._skip_special)

    def push(self, token_ids: list[int]) -> str:
        """Append output tokens; return the text they complete (possibly "" while a character is split)."""
        self._tokens.extend(token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset)
        # Hold back while the new text ends in an incomplete character. A real U+FFFD in the middle (an invalid
        # byte sequence the model produced) cannot complete, so it passes once a valid character follows it.
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        # The window stays anchored on the last emitted tokens so the decoder keeps its left context.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end of the stream: everything still held back, including a trailing U+FFFD if the model
        stopped inside a character (that is what `decode` gives too)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return full_text[len(prefix_text):]
