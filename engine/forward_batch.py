"""One forward's batch: made by `Scheduler.schedule()`, run by `ModelRunner.forward`, read by the model's layers.

The same object carries the batch from the scheduler through the runner and the decode graphs into every attention
layer, so the per-row tensors have one name and one order everywhere (`DECODE_INPUTS` is the order a compiled decode
step takes them in, engine/decode_graphs.py). Two kinds:

- prefill: a chunk of prompt tokens of each of N requests, tokens of all requests concatenated (T tokens in all);
  the logits are those of each chunk's last token.
- decode: one new token for each of B requests (T = N = B); or, verifying speculative drafts
  (engine/speculative.py), request i's last token and its k_i drafts as 1 + k_i consecutive rows on its request
  row (T = N + sum k_i), whose logits are all returned.

Padded decode rows (a bucket larger than the batch) use request row 0, KV slot 0 and sequence length 1
(engine/pools.py keeps row 0 and slot 0 as scratch).
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.ops.attention import prefill_attention  # (the import also registers the ember:: ops)

if TYPE_CHECKING:
    from engine.request import Request


class ForwardMode(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


# The order in which a compiled decode step takes the batch's tensors (after them: req_to_token, k_caches, v_caches):
# the fields' own order, which `ForwardBatch.decode` takes too.
DECODE_INPUTS = ("input_ids", "positions", "req_rows", "out_slots", "seq_lens")


@dataclass(frozen=True)
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64: each token's position in its request
    req_rows: torch.Tensor  # [N] int64: rows of the request-to-token table
    out_slots: torch.Tensor  # [T] int64: the KV slots the forward writes each token's K/V into
    seq_lens: torch.Tensor | None = None  # [N] int64, decode: tokens in the cache after this step
    prefix_lens: torch.Tensor | None = None  # [N] int64, prefill: tokens of each request already in the cache
    prefill_lens: torch.Tensor | None = None  # [N] int64, prefill: tokens of each request in this chunk
    # [N] int64, prefill: each request's length once its whole prefill is done (LongRoPE picks its factors by it)
    fill_lens: torch.Tensor | None = None
    logit_rows: torch.Tensor | None = None  # [N] int64, prefill: the token rows whose logits are returned
    # prefill of embedding requests: the forward returns every token's final-normed hidden state [T, hidden] (fp32)
    # instead of logits
    embed: bool = False
    req_to_token: torch.Tensor | None = None  # the pool's table, attached by the runner
    # Scheduler side, not seen by the model: the requests of the rows, in order, and for a prefill the tokens each
    # contributes and whether its prompt is complete after this chunk (then it is sampled).
    reqs: tuple[Request, ...] = ()
    chunk_lens: tuple[int, ...] = ()
    completes: tuple[bool, ...] = ()
    # decode: each request's draft tokens verified by this step (all empty, or (): plain decode)
    drafts: tuple[tuple[int, ...], ...] = ()

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    @property
    def verifies(self) -> bool:
        return any(self.drafts)

    @property
    def num_rows(self) -> int:
        return int(self.req_rows.numel())

    @property
    def sampled(self) -> list[int]:
        """Indices of the rows that get a token from this forward: every decode row, the prefill rows whose prompt
        (or recompute) is complete."""
        if self.is_decode:
            return list(range(len(self.reqs)))
        if self.embed:
            return []
        return [i for i, done in enumerate(self.completes) if done]

    @classmethod
    def decode(cls, input_ids: torch.Tensor, positions: torch.Tensor, req_rows: torch.Tensor, out_slots: torch.Tensor,
               seq_lens: torch.Tensor | None = None, req_to_token: torch.Tensor | None = None,
               reqs: tuple[Request, ...] = (), drafts: tuple[tuple[int, ...], ...] = ()) -> ForwardBatch:
        """A decode batch: token `input_ids[i]` sits at `positions[i]` of request row `req_rows[i]` and writes its
        K/V into `out_slots[i]`; seq_lens defaults to positions + 1 (the token sees its whole request)."""
        return cls(ForwardMode.DECODE, input_ids, positions, req_rows, out_slots,
                   seq_lens=positions + 1 if seq_lens is None else seq_lens, req_to_token=req_to_token, reqs=reqs,
                   drafts=drafts)

    @classmethod
    def prefill(cls, chunks: list[PrefillChunk], reqs: tuple[Request, ...] = (),
                completes: tuple[bool, ...] = (), embed: bool = False) -> ForwardBatch:
        """A prefill batch of one chunk per request (`chunks[i]` belongs to `reqs[i]` when reqs are given)."""
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        last_rows: list[int] = []
        for c in chunks:
            n = len(c.token_ids)
            ids.extend(c.token_ids)
            positions.append(torch.arange(c.prefix_len, c.prefix_len + n))
            last_rows.append(len(ids) - 1)
        return cls(
            ForwardMode.PREFILL,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.cat(positions),
            req_rows=torch.tensor([c.req_row for c in chunks], dtype=torch.int64),
            out_slots=torch.cat([c.slots for c in chunks]),
            prefix_lens=torch.tensor([c.prefix_len for c in chunks], dtype=torch.int64),
            prefill_lens=torch.tensor([len(c.token_ids) for c in chunks], dtype=torch.int64),
            fill_lens=torch.tensor([max(c.fill_len, c.prefix_len + len(c.token_ids)) for c in chunks]),
            logit_rows=None if embed else torch.tensor(last_rows, dtype=torch.int64),
            embed=embed,
            reqs=reqs,
            chunk_lens=tuple(len(c.token_ids) for c in chunks),
            completes=completes,
        )

    def with_table(self, req_to_token: torch.Tensor) -> ForwardBatch:
        return dataclasses.replace(self, req_to_token=req_to_token)

    def decode_inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in DECODE_INPUTS)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        """One layer's attention over the pool: writes this step's K/V into `out_slots`, reads each row's whole
        context through `req_to_token`."""
        if self.mode is ForwardMode.DECODE:
            return torch.ops.ember.decode_attention(q, k, v, k_cache, v_cache, self.out_slots, self.req_to_token,
                                                    self.req_rows, self.seq_lens, scale)
        # Prefill runs eagerly: the plain function, not the op (see engine/ops/attention.py).
        return prefill_attention(q, k, v, k_cache, v_cache, self.out_slots, self.req_to_token, self.req_rows,
                                 self.prefix_lens, self.prefill_lens, scale)


@dataclass(frozen=True)
class PrefillChunk:
    """New tokens of one request in a prefill batch; `slots` were allocated for exactly these tokens."""

    req_row: int
    prefix_len: int  # tokens of this request already in the KV cache
    token_ids: list[int]
    slots: torch.Tensor  # [len(token_ids)] int64
    # The request's length once its whole prefill is done (0: this chunk's end): LongRoPE picks its factors by it.
    fill_len: int = 0
