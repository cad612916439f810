"""Llama-family decoder (Llama incl. Llama-3 rope scaling, Mistral, Qwen2 qkv bias, Qwen3 q/k norm, Phi-3 LongRoPE and
partial rotary) over the KV pool.

The forward is a pure function of its inputs plus the weights: tokens are flattened to [T] (prefill: all new
tokens of all requests; decode: one per request), caches are passed in per layer, attention inputs arrive
as one `ForwardBatch` (engine/forward_batch.py). Q/K/V and gate/up are fused into one matmul each: fewer, fatter GEMMs suit the
skinny decode shapes, and the loader fills the fused weights slice by slice (no second copy of the weights).
On every CPU tier with packed kernels (AVX2 and up) the loader then packs every dense linear weight for
`ember::linear_bf16` / `linear_f32` (engine/ops/linear.py), or keeps it quantized (engine/quant/, a module in place
of the parameter); `linear`/`embedding` take any of them, so this file does not care which it got.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.loader.model_config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.model.moe import SparseMoE
from engine.model.rope import apply_rope, longrope_rows
from engine.ops.fused import eager_fused, silu_mul
from engine.ops.linear import embedding, linear
from engine.quant.module import QuantizedWeight

LINEAR_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # per layer; the loader packs or quantizes them
LM_HEAD_SLICE = 8192  # rows of the output projection per GEMM (see LlamaModel.forward)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as HF's LlamaRMSNorm: normalise in fp32, cast back, then scale.
    if eager_fused() and x.is_contiguous() and weight.dtype == x.dtype:
        return torch.ops.ember.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, sparse: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.qkv_size, self.inter2 = self.q_size + 2 * self.kv_size, 2 * cfg.intermediate_size
        self.input_layernorm = _param(h)
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, h)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size) if cfg.attention_bias else None
        self.q_norm = _param(d) if cfg.qk_norm else None
        self.k_norm = _param(d) if cfg.qk_norm else None
        self.o_proj = _param(h, self.q_size)
        self.post_attention_layernorm = _param(h)
        # A mixture-of-experts layer (cfg.moe_layers) runs routed experts in place of the dense MLP.
        self.moe = SparseMoE(cfg) if sparse else None
        self.gate_up_proj = None if sparse else _param(2 * cfg.intermediate_size, h)
        self.down_proj = None if sparse else _param(h, cfg.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        h = rms_norm(x, self.input_layernorm, cfg.rms_norm_eps)
        qkv = linear(h, self.qkv_proj, self.qkv_size)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, cfg.num_heads, cfg.head_dim)
        k = k.view(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.contiguous().view(t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = rms_norm(q, self.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        attn = meta.attend(q, k, v, k_cache, v_cache, cfg.head_dim**-0.5)
        x = x + linear(attn.reshape(t, self.q_size), self.o_proj, cfg.hidden_size)
        h = rms_norm(x, self.post_attention_layernorm, cfg.rms_norm_eps)
        if self.moe is not None:
            return x + self.moe(h)
        return x + linear(silu_mul(linear(h, self.gate_up_proj, self.inter2)), self.down_proj, cfg.hidden_size)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                 rope_long: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> None:
        """rope_cos/rope_sin: fp32 [max_positions, rotary_dim] tables (engine/model/rope.py), cast per step like HF.
        rope_long: LongRoPE's long-factor tables and the length past which a request uses them (rope.longrope_rows)."""
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)
        self.register_buffer("rope_cos", rope_cos, persistent=False)
        self.register_buffer("rope_sin", rope_sin, persistent=False)
        self.rope_long_after = None if rope_long is None else rope_long[2]
        self.register_buffer("rope_cos_long", None if rope_long is None else rope_long[0], persistent=False)
        self.register_buffer("rope_sin_long", None if rope_long is None else rope_long[1], persistent=False)

    @staticmethod
    def make_layer(cfg: ModelConfig, index: int) -> nn.Module:
        return DecoderLayer(cfg, index in cfg.moe_layers)

    @property
    def packed(self) -> bool:
        """True when the dense linear weights are packed for ember::linear_bf16 / linear_f32 (engine/model/weights.py)."""
        dense = [w for w in self.linear_weights() if isinstance(w, torch.Tensor)]
        return bool(dense) and dense[0].dim() != 2

    def linear_weights(self) -> list[torch.Tensor | QuantizedWeight]:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        layer_weights = [getattr(layer, a) for layer in self.layers for a in LINEAR_WEIGHTS]
        return [*layer_weights, head]

    def forward(
        self,
        batch: ForwardBatch,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """fp32 logits [N, V]: of each decode row, or of each prefill chunk's last token (batch.logit_rows); for an
        embedding prefill (batch.embed) every token's final-normed hidden state [T, hidden] instead."""
        positions = batch.positions
        x = embedding(batch.input_ids, self.embed_tokens, self.norm.dtype)  # the norms are in the serving dtype
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        if self.rope_long_after is not None:  # LongRoPE past its original context
            use_long = longrope_rows(batch, self.rope_long_after)[:, None]
            cos = torch.where(use_long, self.rope_cos_long[positions], cos)
            sin = torch.where(use_long, self.rope_sin_long[positions], sin)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches):
            x = layer(x, cos, sin, batch, k_cache, v_cache)
        if batch.embed:
            return rms_norm(x, self.norm, self.cfg.rms_norm_eps).float()
        if batch.logit_rows is not None:
            x = x.index_select(0, batch.logit_rows)
        return self.logits(rms_norm(x, self.norm, self.cfg.rms_norm_eps))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, V] of final-normed hidden states."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if isinstance(head, QuantizedWeight):  # engine/quant/: fp32 logits from the kernel where it can
            return head.logits(x)
        if head.dim() != 2:  # packed for ember::linear_bf16 / linear_f32
            return linear(x, head, self.cfg.vocab_size).float()
        # oneDNN's bf16 GEMM over one vocabulary-wide weight ran 1.4-2.5x slower than over 8192-row slices
        # of it on this machine (49152 x 576: 11.8 -> 8.3 ms at batch 1, 40.9 -> 18.9 ms at batch 32).
        return torch.cat([F.linear(x, w) for w in head.split(LM_HEAD_SLICE)], dim=-1).float()
