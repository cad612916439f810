"""What a `phi3` GGUF holds beyond a llama one, read the way llama.cpp's converter (Phi3MiniModel) writes it.

The weights stay fused (`attn_qkv` is HF's qkv_proj; `ffn_up` holds gate and up, HF's gate_up_proj) and are not
permuted (llama.cpp runs phi3 with neox rope, like HF). The converter writes no `rope.scaling.type`: LongRoPE is the
`rope_factors_long` / `rope_factors_short` tensors with `rope.scaling.original_context_length` and `attn_factor`;
`rope.dimension_count` is the rotary part of a head (partial_rotary_factor); `attention.sliding_window` 0 means none.
transformers reads none of these from a GGUF, so `fix_phi3_config` sets them on its config.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from engine.loader.model_config import UnsupportedModelError

# GGUF block tensor -> HF name inside a layer, where phi3 differs from llama.
PHI3_BLOCK_NAMES: dict[str, str] = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
ROPE_FACTOR_TENSORS: tuple[str, ...] = ("rope_factors_long.weight", "rope_factors_short.weight")
# llama.cpp ends a turn at these tokens whatever the file's eos says (its end-of-generation detection by text);
# Phi-3 GGUFs often carry eos = <|endoftext|> while the chat template ends every turn with <|end|>.
_END_OF_TURN_TEXTS: tuple[bytes, ...] = (b"<|end|>",)


def phi3_q_rows(reader: GGUFReader, num_heads: int, num_kv_heads: int) -> int | None:
    """Rows of the Q part of the fused blk.0.attn_qkv ([(heads + 2 kv_heads) * head_dim, hidden])."""
    qkv = next((t for t in reader.tensors if t.name == "blk.0.attn_qkv.weight"), None)
    if qkv is None:
        return None
    rows = int(qkv.shape[-1])
    if rows % (num_heads + 2 * num_kv_heads):
        raise UnsupportedModelError(f"blk.0.attn_qkv has {rows} rows: not (heads + 2 kv heads) x head_dim")
    return rows // (num_heads + 2 * num_kv_heads) * num_heads


def fix_phi3_config(reader: GGUFReader, cfg: Any) -> None:
    """Set partial rotary, LongRoPE and the sliding window from the file on `cfg` (a Phi3Config with its head_dim)."""
    params = dict(cfg.rope_parameters)
    rope_dims = _meta(reader, "phi3.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != cfg.head_dim:
        factor = int(rope_dims) / cfg.head_dim
        if int(cfg.head_dim * factor) != int(rope_dims):
            raise UnsupportedModelError(f"phi3.rope.dimension_count {rope_dims} of head_dim {cfg.head_dim}")
        params["partial_rotary_factor"] = factor
    factors = {t.name: t for t in reader.tensors if t.name in ROPE_FACTOR_TENSORS}
    if factors:
        if len(factors) != 2:
            raise UnsupportedModelError(f"GGUF has only {', '.join(factors)}: LongRoPE needs both factor tensors")
        original = _meta(reader, "phi3.rope.scaling.original_context_length")
        if original is None:
            raise UnsupportedModelError("GGUF LongRoPE factors without phi3.rope.scaling.original_context_length")
        long, short = (_factors(factors[n]) for n in ROPE_FACTOR_TENSORS)
        params.update(rope_type="longrope", long_factor=long, short_factor=short,
                      original_max_position_embeddings=int(original))
        cfg.original_max_position_embeddings = int(original)
        attn_factor = _meta(reader, "phi3.rope.scaling.attn_factor")
        # The converter writes transformers' default (from max / original context); keep any other value.
        scale = cfg.max_position_embeddings / int(original)
        default = math.sqrt(1 + math.log(scale) / math.log(int(original))) if scale > 1.0 else 1.0
        if attn_factor is not None and not math.isclose(float(attn_factor), default, rel_tol=1e-6):
            params["attention_factor"] = float(attn_factor)
    cfg.rope_parameters = params
    window = _meta(reader, "phi3.attention.sliding_window")
    cfg.sliding_window = int(window) if window else None


def phi3_end_of_turn_ids(reader: GGUFReader) -> list[int]:
    """Ids of the end-of-turn tokens in the file's vocabulary (none when the file has no vocabulary)."""
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        return []
    return [i for i, part in enumerate(field.data) if field.parts[part].tobytes() in _END_OF_TURN_TEXTS]


def _factors(tensor: Any) -> list[float]:
    # float32 in the file; transformers turns the config's lists into float32 too, so the frequencies are identical.
    return [float(v) for v in dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(-1)]


def _meta(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()
