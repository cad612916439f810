"""The mixture-of-experts part of a model's shape (Qwen3-MoE, Mixtral), read from a transformers config.

Both route every token of a sparse layer to `num_experts_per_tok` of `num_experts` SwiGLU experts (softmax over the
router logits, top-k); neither has shared experts (Qwen2-MoE, not supported, does). Qwen3-MoE renormalises the
top-k weights only with `norm_topk_prob` and may keep some layers dense (`mlp_only_layers`, `decoder_sparse_step`);
Mixtral always renormalises and every layer is sparse.
"""
from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

MOE_ARCHITECTURES: tuple[str, ...] = ("qwen3_moe", "mixtral")


def moe_fields(cfg: PretrainedConfig, architecture: str) -> dict[str, Any]:
    """ModelConfig's MoE fields (num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
    moe_layers); {} for a dense architecture (the defaults: no experts)."""
    if architecture not in MOE_ARCHITECTURES:
        return {}
    layers = int(cfg.num_hidden_layers)
    if architecture == "mixtral":
        experts = int(cfg.num_local_experts)
        return dict(num_experts=experts, num_experts_per_tok=int(cfg.num_experts_per_tok),
                    moe_intermediate_size=int(cfg.intermediate_size), norm_topk_prob=True,
                    moe_layers=tuple(range(layers)) if experts > 0 else ())
    experts = int(cfg.num_experts)
    dense = {int(i) for i in getattr(cfg, "mlp_only_layers", None) or ()}
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    # Qwen3MoeDecoderLayer's rule: sparse unless listed in mlp_only_layers, and only every `step`-th layer.
    sparse = tuple(i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0)
    return dict(num_experts=experts, num_experts_per_tok=int(cfg.num_experts_per_tok),
                moe_intermediate_size=int(cfg.moe_intermediate_size),
                norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", False)), moe_layers=sparse)
