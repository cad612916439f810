"""Rotary position embeddings (neox "rotate half" layout, as HF Llama/Qwen), as a cos/sin table by position."""
from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def inv_freq_and_scaling(hf_config: PretrainedConfig, rope_type: str, theta: float, head_dim: int) -> tuple[torch.Tensor, float]:
    """inv_freq computed exactly as transformers does, so fp32 parity holds for every rope type it knows."""
    if rope_type == "default":
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, linear, llama3, yarn")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def rope_table(inv_freq: torch.Tensor, scaling: float, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [max_pos, head_dim], fp32. Same arithmetic as HF: pos * inv_freq, duplicated halves."""
    freqs = torch.arange(max_pos, dtype=torch.float)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, D] already in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
