"""Fake kernels for `ember::decode_attention` and `ember::prefill_attention`: output shape = q's shape.

Whatever the caches hold (--kv-cache-dtype: q's dtype, the other float dtype, or int8 rows of head_dim + 4 bytes with
their scale, or the same in float8_e4m3fn: engine/ops/kv_quant.py), the output is q's shape and dtype, so one fake serves every KV dtype."""
from __future__ import annotations

import torch

import engine.ops.attention  # noqa: F401  (defines the ops the fakes attach to)


@torch.library.register_fake("ember::decode_attention")
def _decode_attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.register_fake("ember::prefill_attention")
def _prefill_attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    prefill_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(q)
