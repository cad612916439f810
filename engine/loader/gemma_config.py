"""What a Gemma 3 text config adds to ModelConfig: two rope bases, the sliding window and which layers use it,
the query scale and the logit soft-cap. Read from transformers' Gemma3TextConfig (HF folders and GGUF files alike)."""
from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from engine.loader.errors import UnsupportedModelError

GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")  # GeGLU with the tanh GELU, as HF's ACT2FN names it


def gemma_rope(cfg: PretrainedConfig) -> tuple[float, dict[str, Any] | None, float]:
    """(global theta, global HF-style scaling or None, local theta). transformers 5.x keeps one rope dict per layer
    type; the local (sliding) layers always run plain rope in the released models, so anything else is refused."""
    params = getattr(cfg, "rope_parameters", None) or {}
    full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"sliding-window layers with rope type {local['rope_type']!r} are not supported")
    theta = float(full.pop("rope_theta", 1_000_000.0))
    rope_type = full.pop("rope_type", "default")
    scaling = None if rope_type == "default" else {"rope_type": rope_type, **full}
    return theta, scaling, float(local.get("rope_theta", 10_000.0))


def gemma_fields(cfg: PretrainedConfig) -> dict[str, Any]:
    """ModelConfig fields of a Gemma 3 model; raises for the options the engine does not run."""
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    if act not in GEMMA_ACTIVATIONS:
        raise UnsupportedModelError(f"Gemma 3 with hidden_activation {act!r}; supported: {', '.join(GEMMA_ACTIVATIONS)}")
    if getattr(cfg, "attn_logit_softcapping", None):
        raise UnsupportedModelError("attention logit soft-capping (Gemma 2) is not supported")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise UnsupportedModelError("bidirectional attention (EmbeddingGemma) is not supported: not a causal LM")
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"unsupported layer types {sorted(unknown)}")
    window = int(getattr(cfg, "sliding_window", None) or 0)
    windowed = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention") if window else ()
    _, _, local_theta = gemma_rope(cfg)
    return {
        "sliding_window": window,
        "window_layers": windowed,
        "local_rope_theta": local_theta,
        "query_scale": float(cfg.query_pre_attn_scalar) ** -0.5,
        "final_logit_softcap": float(getattr(cfg, "final_logit_softcapping", None) or 0.0),
    }
