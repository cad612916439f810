"""One forward's batch: made by `Scheduler.schedule()`, run by `ModelRunner.forward`, read by the model's layers.

The same object carries the batch from the scheduler through the runner and the decode graphs into every attention
layer, so the per-row tensors have one name and one order everywhere (`DECODE_INPUTS` is the order a compiled decode
step takes them in, engine/decode_graphs.py). Two kinds:

- prefill: a chunk of prompt tokens of each of N requests, tokens of all requests concatenated (T tokens in all);
  the logits are those of each chunk's last token.
- decode: one new token for each of B requests (T = N = B); or, verifying speculative drafts
  (engine/speculative.py), request i's last token and its k_i drafts as 1 + k_i consecutive rows on its request
  row (T = N + sum k_i), whose logits are all returned.
- mixed (`ForwardBatch.mixed`): a decode batch's rows riding in a prefill forward, each request's rows one chunk
  of its own in front of the prompts' chunks; the logits of every decode row, then of each prompt chunk's last
  token. `parts` keeps the two batches it was made of: the output processor and the scheduler handle each as
  they would alone.

Padded decode rows (a bucket larger than the batch) use request row 0, KV slot 0 and sequence length 1
(engine/pools.py keeps row 0 and slot 0 as scratch).
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
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
    # mixed: the decode batch and the prefill batch it carries; decode_rows: that many leading tokens are decode rows
    parts: tuple[ForwardBatch, ForwardBatch] | None = None
    decode_rows: int = 0

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

    @classmethod
    def mixed(cls, decode: ForwardBatch, prefill: ForwardBatch) -> ForwardBatch:
        """One prefill forward for both: the decode rows cost a prefill's GEMMs a few rows more, where a decode step
        of their own would stream every weight again (SmolLM2: 8 more rows on a 242-token prompt within noise, 32 more
        ~8 ms, against an 8-row decode step of 12-16 ms). Each decode request's rows are a chunk on its request row
        starting at its position, so the prefill attention's causal mask over a chunk is the verify rows' mask."""
        assert decode.is_decode and not prefill.is_decode and not prefill.embed
        assert prefill.prefix_lens is not None and prefill.prefill_lens is not None and prefill.fill_lens is not None
        assert prefill.logit_rows is not None
        per_req = [1 + len(d) for d in decode.drafts] if decode.drafts else [1] * len(decode.reqs)
        firsts = torch.tensor([0, *itertools.accumulate(per_req)][:-1], dtype=torch.int64)
        lens = torch.tensor(per_req, dtype=torch.int64)
        starts = decode.positions[firsts]
        t = decode.num_rows
        return cls(
            ForwardMode.PREFILL,
            input_ids=torch.cat([decode.input_ids, prefill.input_ids]),
            positions=torch.cat([decode.positions, prefill.positions]),
            req_rows=torch.cat([decode.req_rows[firsts], prefill.req_rows]),
            out_slots=torch.cat([decode.out_slots, prefill.out_slots]),
            prefix_lens=torch.cat([starts, prefill.prefix_lens]),
            prefill_lens=torch.cat([lens, prefill.prefill_lens]),
            fill_lens=torch.cat([starts + lens, prefill.fill_lens]),
            logit_rows=torch.cat([torch.arange(t), prefill.logit_rows + t]),
            reqs=(*decode.reqs, *prefill.reqs),
            parts=(decode, prefill),
            decode_rows=t,
        )

    def with_table(self, req_to_token: torch.Tensor) -> ForwardBatch:
        parts = None if self.parts is None else (self.parts[0].with_table(req_to_token),
                                                 self.parts[1].with_table(req_to_token))
        return dataclasses.replace(self, req_to_token=req_to_token, parts=parts)

    def decode_inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in DECODE_INPUTS)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        """One layer's attention over the pool: writes this step's K/V into `out_slots`, reads each row's whole
        context through `req_to_token`."""
        if self.mode is ForwardMode.DECODE:
            return torch.ops.ember.decode_attention(q, k, v, k_cache, v_cache, self.out_slots, self.req_to_token,
                                                    self.req_rows, self.seq_lens, scale)
        if self.parts is not None:
            # Mixed: the decode rows through the decode kernel (the prefill kernel's tiles of query rows cost a
            # one-row chunk ~3x as much: SmolLM2, 8 rows over ~260 positions, +6 ms a forward), then the prompts.
            d, (dec, pre) = self.decode_rows, self.parts
            return torch.cat([
                torch.ops.ember.decode_attention(q[:d], k[:d], v[:d], k_cache, v_cache, dec.out_slots,
                                                 self.req_to_token, dec.req_rows, dec.seq_lens, scale),
                pre.attend(q[d:], k[d:], v[d:], k_cache, v_cache, scale)])
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
