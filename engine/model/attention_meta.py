"""Per-step attention inputs. One object per forward; each layer calls `attend` with its own K/V cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.ops.attention import extend_attention  # (the import also registers the ember:: ops)


@dataclass(frozen=True)
class DecodeMeta:
    """One new token per request. Padded rows use request row 0, slot 0, length 1."""

    out_slots: torch.Tensor  # [B] int64
    req_to_token: torch.Tensor
    req_rows: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return torch.ops.ember.decode_attention(
            q, k, v, k_cache, v_cache, self.out_slots, self.req_to_token, self.req_rows, self.seq_lens, scale
        )


@dataclass(frozen=True)
class ExtendMeta:
    """A chunk of new tokens per request (prefill), tokens of all requests concatenated."""

    out_slots: torch.Tensor  # [T] int64
    req_to_token: torch.Tensor
    req_rows: torch.Tensor  # [N] int64
    prefix_lens: torch.Tensor  # [N] int64
    extend_lens: torch.Tensor  # [N] int64
    fill_lens: torch.Tensor | None = None  # [N] int64: each request's length once its whole prefill is done

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        # Prefill runs eagerly: the plain function, not the op (see engine/ops/attention.py).
        return extend_attention(
            q, k, v, k_cache, v_cache, self.out_slots, self.req_to_token, self.req_rows,
            self.prefix_lens, self.extend_lens, scale,
        )


AttentionMeta = DecodeMeta | ExtendMeta
