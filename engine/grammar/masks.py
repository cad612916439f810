"""Token masks of grammar-constrained rows, applied to a step's logits.

Only constrained rows pay: their matchers fill one bit per vocabulary entry (llguidance, ~25 us a row), the
bits become an additive bias of 0 or -inf on the rows' logits. Free rows are not touched, so their
tokens are the same as in a batch without constrained rows.
"""
from __future__ import annotations

from collections.abc import Sequence

import llguidance
import numpy as np
import torch

# Row b: the additive bias of the 8 tokens whose bits byte value b holds (bit j = token 8 k + j allowed).
_BYTE_TO_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
                         np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


class MaskBuffer:
    """A reusable [rows, words] int32 bitmask (llguidance's layout: bit j of word w is token 32 w + j)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._buf = torch.zeros((0, self.words), dtype=torch.int32)

    def fill(self, matchers: Sequence[llguidance.LLMatcher]) -> torch.Tensor:
        if self._buf.shape[0] < len(matchers):
            self._buf = torch.zeros((max(len(matchers), 2 * self._buf.shape[0]), self.words), dtype=torch.int32)
        out = self._buf[: len(matchers)]
        row_bytes = self.words * 4
        for i, m in enumerate(matchers):
            # Writes the row in place (llguidance drops the GIL while it computes).
            m.unsafe_compute_mask_ptr(out[i].data_ptr(), row_bytes)
        return out

    def bias(self, matchers: Sequence[llguidance.LLMatcher]) -> torch.Tensor:
        """[rows, vocab_size] float32: 0 where the row's grammar allows the token next, -inf elsewhere."""
        packed = self.fill(matchers).numpy().view(np.uint8)  # little-endian: byte b of a row holds tokens 8b..8b+7
        # A byte -> 8 floats lookup: a branch-free gather, ~18 us a row, where masked_fill with the unpacked bits
        # measured ~90 us a row (a mask that mixes allowed and disallowed tokens defeats branch prediction).
        return torch.from_numpy(np.take(_BYTE_TO_BIAS, packed, axis=0).reshape(len(matchers), -1)[:, : self.vocab_size])


def apply_masks(logits: torch.Tensor, rows: list[int], bias: torch.Tensor) -> None:
    """Add the grammar bias (0 or -inf) to the logits of `rows`, in place. `logits` is [B, V]."""
    if len(rows) == logits.shape[0]:
        logits.add_(bias)
        return
    for i, row in enumerate(rows):  # per row: index_put_ with accumulate measured ~15x slower
        logits[row].add_(bias[i])
