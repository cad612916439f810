"""Rotary position embeddings (neox "rotate half" layout, as HF Llama/Qwen), as a cos/sin table by position."""
from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.forward_batch import ForwardBatch
from engine.ops.fused import eager_fused


def inv_freq_and_scaling(hf_config: PretrainedConfig, rope_type: str, theta: float, rotary_dim: int,
                         layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """inv_freq computed exactly as transformers does, so fp32 parity holds for every rope type it knows.
    rotary_dim: the dims of a head that rope turns (ModelConfig.rotary_dim; the other types read it from hf_config).
    layer_type: the key of a per-layer-type rope dict (Gemma 3's "full_attention")."""
    if rope_type == "default":
        return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, linear, llama3, yarn")
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scaling)


def rope_table(inv_freq: torch.Tensor, scaling: float, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [max_pos, rotary_dim], fp32. Same arithmetic as HF: pos * inv_freq, duplicated halves."""
    freqs = torch.arange(max_pos, dtype=torch.float)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def longrope_long_table(hf_config: PretrainedConfig, max_pos: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """LongRoPE's second table: (cos, sin, original_max_position_embeddings), or None when `max_pos` never passes it.

    transformers builds inv_freq from `short_factor` and swaps in `long_factor` for a forward whose sequence is
    longer than original_max_position_embeddings (dynamic_rope_update); the attention scaling is the same for both.
    The model picks a table per token with `longrope_rows`."""
    original = int(hf_config.rope_parameters["original_max_position_embeddings"])
    if max_pos <= original:
        return None
    fn = ROPE_INIT_FUNCTIONS["longrope"]
    _, scaling = fn(hf_config, torch.device("cpu"))
    long_inv_freq, _ = fn(hf_config, torch.device("cpu"), seq_len=original + 1)
    return (*rope_table(long_inv_freq.float(), float(scaling), max_pos), original)


def longrope_rows(batch: ForwardBatch, original_max: int) -> torch.Tensor:
    """[T] bool: which tokens take LongRoPE's long factors. transformers' rule, per request: long when the sequence
    of its forward is longer than `original_max`; a prompt is one forward there, so every chunk of a chunked prefill
    goes by the length the whole prefill reaches (batch.fill_lens). Keys already in the cache keep the factors they
    were computed with, as in transformers' own cache when decoding crosses `original_max`."""
    if not batch.is_decode:
        assert batch.prefix_lens is not None and batch.prefill_lens is not None
        ends = batch.prefix_lens + batch.prefill_lens if batch.fill_lens is None else batch.fill_lens
        return torch.repeat_interleave(ends > original_max, batch.prefill_lens)
    return batch.positions >= original_max  # decode: the sequence is position + 1 long


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, R] already in x's dtype, R <= D: partial rotary turns the first R dims only."""
    if eager_fused() and x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous():
        return torch.ops.ember.rope(x, cos, sin)
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
