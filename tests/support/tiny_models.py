"""Tiny random HF model folders of each supported architecture, with a real byte-level BPE tokenizer.

Everything is built here (the tokenizer is trained on a few sentences), so nothing is downloaded. The weights
are random, so the text is gibberish, but every loader, tokenizer and chat-template path is the real one.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

TINY_ARCHS: tuple[str, ...] = ("llama", "llama3", "mistral", "qwen2", "qwen3")
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
_CORPUS = [
    "The capital of France is Paris. Hello world, how are you today?",
    "a quick brown fox jumps over the lazy dog 0123456789",
    "Once upon a time there was a small model that answered questions.",
]
_CONFIGS: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "llama3": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (every byte is a token, plus merges learnt from _CORPUS) with ChatML specials."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS * 10, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.chat_template = CHATML
    return tok


def tiny_config(arch: str, tok: PreTrainedTokenizerFast, **overrides: Any) -> PretrainedConfig:
    """2 layers, hidden 64, 4 heads of 16, 2 KV heads; `overrides` are config kwargs."""
    if arch not in _CONFIGS:
        raise ValueError(f"unknown tiny arch {arch!r}; one of {TINY_ARCHS}")
    kwargs: dict[str, Any] = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if arch == "llama3":
        kwargs["rope_parameters"] = dict(LLAMA3_ROPE)
    if arch == "mistral":
        kwargs["sliding_window"] = None  # windowed attention is tested through overrides
    kwargs.update(overrides)
    return _CONFIGS[arch](**kwargs)


def write_tiny_model(
    folder: Path, arch: str, *, seed: int = 0, max_shard_size: str | None = None, chat_template: str | None = None,
    generation: dict[str, Any] | None = None, **overrides: Any
) -> Path:
    """Save a random fp32 model, its tokenizer and generation config into `folder` (safetensors).
    `chat_template` replaces the ChatML one; `generation` adds keys to generation_config.json (temperature, ...)."""
    tok = tiny_tokenizer()
    if chat_template is not None:
        tok.chat_template = chat_template
    cfg = tiny_config(arch, tok, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        # Random norms are all ones; perturb them so a loader that mixed up two norms would be caught.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.1)
        # A peaked output distribution gives greedy decoding clear margins in parity tests.
        model.get_output_embeddings().weight.mul_(8.0)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    GenerationConfig(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id).save_pretrained(folder)
    if generation:  # written as given: GenerationConfig would validate (and reject) e.g. temperature 0
        path = folder / "generation_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **generation}, indent=2))
    return folder


# From the R1 distills' published template: the generation prompt ends with <｜Assistant｜><think>\n.
R1_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'].split('</think>')[-1]"
    " + '<｜end▁of▁sentence｜>' }}{% else %}{{ message['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)
