"""Gemma 3 text decoder (Gemma3ForCausalLM) over the KV pool and, for its sliding-window layers, the window rings.

Where it differs from the Llama frame it reuses (engine/model/llama.py):
- RMSNorm scales by (1 + weight), in fp32 before the cast back (HF's Gemma3RMSNorm); every sublayer's output is
  normed again (post-attention, post-feedforward) before it joins the residual, and the MLP input has its own norm.
- q/k norms (per head, same (1 + weight) form), GeGLU with the tanh GELU, scores scaled by query_pre_attn_scalar.
- Embeddings are multiplied by sqrt(hidden) rounded to the serving dtype first (55.4256 is 55.5 in bf16), as HF does.
- Window layers take the local rope base and see only the last `sliding_window` positions: kept in a ring per
  request when the prefix cache is off (engine/pools.py WindowKVPool, engine/model/window.py), else in slots of their
  own, one per position still in some window (engine/window_slots.py); the full layers take the global base.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.loader.model_config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.model.llama import LlamaModel, _param
from engine.model.rope import apply_rope
from engine.model.window import WindowPoolPrefillMeta, WindowPrefillMeta, pool_window_meta, window_meta
from engine.ops.linear import embedding, linear


def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


class Gemma3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.qkv_size, self.inter2 = self.q_size + 2 * self.kv_size, 2 * cfg.intermediate_size
        self.input_layernorm = _param(h)
        self.qkv_proj = _param(self.qkv_size, h)
        self.q_norm, self.k_norm = _param(d), _param(d)
        self.o_proj = _param(h, self.q_size)
        self.post_attention_layernorm = _param(h)
        self.pre_feedforward_layernorm = _param(h)
        self.gate_up_proj = _param(self.inter2, h)
        self.down_proj = _param(h, cfg.intermediate_size)
        self.post_feedforward_layernorm = _param(h)
        self.moe = None  # (the weight loaders ask)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: ForwardBatch | WindowPrefillMeta | WindowPoolPrefillMeta,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        cfg, t, eps = self.cfg, x.shape[0], self.cfg.rms_norm_eps
        h = gemma_norm(x, self.input_layernorm, eps)
        q, k, v = linear(h, self.qkv_proj, self.qkv_size).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = gemma_norm(q.view(t, cfg.num_heads, cfg.head_dim), self.q_norm, eps)
        k = gemma_norm(k.view(t, cfg.num_kv_heads, cfg.head_dim), self.k_norm, eps)
        v = v.contiguous().view(t, cfg.num_kv_heads, cfg.head_dim)
        attn = meta.attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, k_cache, v_cache, cfg.query_scale)
        attn = linear(attn.reshape(t, self.q_size), self.o_proj, cfg.hidden_size)
        x = x + gemma_norm(attn, self.post_attention_layernorm, eps)
        h = gemma_norm(x, self.pre_feedforward_layernorm, eps)
        gate, up = linear(h, self.gate_up_proj, self.inter2).chunk(2, dim=-1)
        mlp = linear(F.gelu(gate, approximate="tanh") * up, self.down_proj, cfg.hidden_size)
        return x + gemma_norm(mlp, self.post_feedforward_layernorm, eps)


class Gemma3Model(LlamaModel):
    def __init__(self, cfg: ModelConfig, rope_cos: torch.Tensor, rope_sin: torch.Tensor, local_cos: torch.Tensor,
                 local_sin: torch.Tensor, embed_scale: torch.Tensor) -> None:
        """rope_cos/sin: the full layers' tables; local_cos/sin: the window layers'; embed_scale: sqrt(hidden), fp32."""
        super().__init__(cfg, rope_cos, rope_sin)
        self.register_buffer("local_cos", local_cos, persistent=False)
        self.register_buffer("local_sin", local_sin, persistent=False)
        self.register_buffer("embed_scale", embed_scale, persistent=False)
        self.window_layers = frozenset(cfg.window_layers)
        self.register_buffer("ring_table", None, persistent=False)  # set by use_rings
        self.register_buffer("window_map", None, persistent=False)  # set by use_window_slots

    @staticmethod
    def make_layer(cfg: ModelConfig, index: int) -> nn.Module:
        return Gemma3Layer(cfg)

    @property
    def needs_rings(self) -> bool:
        """Whether the window is shorter than the context: otherwise a window layer sees everything anyway and runs
        over the full pool like the others."""
        return bool(self.window_layers) and self.cfg.sliding_window < self.rope_cos.shape[0]

    def use_rings(self, ring_table: torch.Tensor) -> None:
        """Run the window layers over rings (the caches passed for them are then WindowKVPool buffers)."""
        self.ring_table = ring_table

    def use_window_slots(self, window_map: torch.Tensor) -> None:
        """Run the window layers over slots of their own (the caches passed for them are then WindowSlots buffers,
        engine/window_slots.py): `window_map` maps each token-pool slot to its window slot."""
        self.window_map = window_map

    def forward(self, batch: ForwardBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> torch.Tensor:
        cfg, positions = self.cfg, batch.positions
        x = embedding(batch.input_ids, self.embed_tokens, self.norm.dtype)
        x = x * self.embed_scale.to(x.dtype)
        cos, sin = self.rope_cos[positions].to(x.dtype), self.rope_sin[positions].to(x.dtype)
        lcos, lsin = self.local_cos[positions].to(x.dtype), self.local_sin[positions].to(x.dtype)
        if self.ring_table is not None:
            local = window_meta(batch, self.ring_table, cfg.sliding_window)
        elif self.needs_rings:  # no rings (the prefix cache on): a slot per position, through window_map if set
            local = pool_window_meta(batch, cfg.sliding_window, self.window_map)
        else:
            local = batch
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.layers, k_caches, v_caches)):
            if i in self.window_layers:
                x = layer(x, lcos, lsin, local, k_cache, v_cache)
            else:
                x = layer(x, cos, sin, batch, k_cache, v_cache)
        if batch.embed:
            return gemma_norm(x, self.norm, cfg.rms_norm_eps).float()
        if batch.logit_rows is not None:
            x = x.index_select(0, batch.logit_rows)
        logits = self.logits(gemma_norm(x, self.norm, cfg.rms_norm_eps))
        if cfg.final_logit_softcap:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
        return logits
