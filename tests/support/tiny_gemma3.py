"""A tiny random Gemma 3 (Gemma3ForCausalLM) folder with sliding-window layers, and its transformers oracle."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, GenerationConfig, PreTrainedModel

from tiny_models import tiny_tokenizer

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2  # every third layer global
ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0}}
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role'])"
    " + '\n' + m['content'] + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<start_of_turn>model\n' }}{% endif %}"
)


def write_tiny_gemma3(folder: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """A random fp32 Gemma3ForCausalLM: 6 layers, hidden 64, 4 heads of 16, 2 KV heads, window 8, query scale
    24^-0.5, a Gemma-style chat template; generation ends at <end_of_turn> or the eos."""
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = GEMMA_TEMPLATE
    kwargs: dict[str, Any] = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=WINDOW,
        layer_types=LAYER_TYPES, query_pre_attn_scalar=24, rope_parameters={k: dict(v) for k, v in ROPE.items()},
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    kwargs.update(overrides)
    cfg = Gemma3TextConfig(**kwargs)
    cfg.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # zeros in a fresh model: the (1 + w) form would hide a missing 1
                p.add_(torch.randn_like(p) * 0.1)
        model.get_output_embeddings().weight.mul_(8.0)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    model.save_pretrained(folder)
    end = tok.convert_tokens_to_ids("<end_of_turn>")
    GenerationConfig(eos_token_id=[tok.eos_token_id, end], bos_token_id=tok.bos_token_id).save_pretrained(folder)
    return folder


def hf_gemma3(folder: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logits(hf: PreTrainedModel, seq: list[int], prompt_len: int) -> torch.Tensor:
    """Logits of every position from the prompt's last on, one forward (Gemma 3's rope does not depend on it)."""
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0, prompt_len - 1 :]
