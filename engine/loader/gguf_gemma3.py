"""What a `gemma3` GGUF holds beyond a llama one, read the way llama.cpp writes and runs it (Gemma3Model in its
converter, LLM_ARCH_GEMMA3 in its loader).

- Every RMSNorm weight is stored as (1 + w): llama.cpp then multiplies plainly. HF's Gemma3RMSNorm, which Ember
  follows, adds the 1 itself, so the loader subtracts it again (as transformers' own GGUF reader does).
- Block norms: `post_attention_norm` normalises the attention output, `ffn_norm` is the *pre*-feedforward norm (in a
  llama file it is the post-attention one) and `post_ffw_norm` the post-feedforward one. Q/K are not permuted (neox
  rope, as in HF).
- transformers reads the window, the layer shape and the global rope base, but not what llama.cpp hard-codes: the
  local rope base (10000 unless the file has `rope.freq_base_swa`), every 6th layer global (unless the file has
  `attention.sliding_window_pattern`), and the query scale: 1/sqrt(head_dim), except the 27B model (62 layers),
  which scales by 1/sqrt(hidden / heads). `fix_gemma3_config` sets those on the config.
"""
from __future__ import annotations

from typing import Any

from gguf import GGUFReader

from engine.loader.errors import UnsupportedModelError

GEMMA3_BLOCK_NAMES: dict[str, str] = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_DEFAULT_PATTERN = 6  # llama.cpp: hparams.set_swa_pattern(6), every 6th layer full attention
_LOCAL_THETA = 10_000.0
_27B_LAYERS = 62


def gemma3_norm_offset(hf_name: str) -> float:
    """What to add to a stored tensor to get HF's weight: -1 for the norms, 0 for the rest."""
    return -1.0 if hf_name.endswith("norm.weight") else 0.0


def fix_gemma3_config(reader: GGUFReader, cfg: Any, rope_scaling: dict[str, Any] | None) -> None:
    """Set the layer types, local rope base, query scale and global rope scaling on `cfg` (a Gemma3TextConfig)."""
    layers = int(cfg.num_hidden_layers)
    pattern = _meta(reader, "gemma3.attention.sliding_window_pattern")
    if pattern is None or isinstance(pattern, int):
        period = int(pattern or _DEFAULT_PATTERN)
        sliding = [bool((i + 1) % period) for i in range(layers)]
    else:  # one flag per layer, true = sliding window
        sliding = [bool(p) for p in pattern]
        if len(sliding) != layers:
            raise UnsupportedModelError(f"gemma3.attention.sliding_window_pattern has {len(sliding)} entries "
                                        f"for {layers} layers")
    cfg.layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
    params = {k: dict(v) for k, v in cfg.rope_parameters.items()}
    local = _meta(reader, "gemma3.rope.freq_base_swa")
    params["sliding_attention"] = {"rope_type": "default", "rope_theta": float(local or _LOCAL_THETA)}
    if rope_scaling is not None:
        params["full_attention"].update(rope_scaling)
    cfg.rope_parameters = params
    heads = int(cfg.num_attention_heads)
    cfg.query_pre_attn_scalar = cfg.hidden_size // heads if layers == _27B_LAYERS else cfg.head_dim


def _meta(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()
