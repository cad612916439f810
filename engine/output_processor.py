"""After a forward: the new KV becomes the requests' own, the next tokens are sampled and appended, finished
requests are decided and give their KV back, and their outputs are staged (the third phase of an engine step,
engine/core.py).

Stops are checked in this order: stop token ids / EOS (the token is not turned into text), stop strings (on
the detokenized text, across token boundaries), the end of a grammar (reason `stop`: a constrained output is
complete), then max_tokens and the context length (reason `length`).

Grammar-constrained rows get their token masks applied to the logits before anything else, so every
processor, logprob and draw sees only the tokens the grammar allows. min_tokens does not ban EOS on them:
the grammar alone decides where the output may end.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch
from engine.kv_manager import KVManager
from engine.outputs import FinishReason, RequestOutput, TokenLogprob
from engine.request import ReqStatus, Request
from engine.grammar.masks import MaskBuffer, apply_masks
from engine.sampler import SamplingBatch, argmax_rows, sample
from engine.speculative import Speculator

log = logging.getLogger("ember.engine")


@dataclass(frozen=True)
class _Row:
    """One row to sample: `req` after `output_ids` (its own, or with drafts appended while verifying them)."""

    req: Request
    output_ids: list[int]
    bias: torch.Tensor | None = None  # a draft row's grammar mask (0 / -inf per token), computed ahead


class OutputProcessor:
    def __init__(self, kvm: KVManager, eos_token_ids: tuple[int, ...], vocab_size: int, max_context: int,
                 speculator: Speculator | None = None) -> None:
        self.kvm, self.speculator = kvm, speculator
        self.appended = 0  # tokens the last processed batch added
        self.eos = frozenset(eos_token_ids)
        self.vocab_size, self.max_context = vocab_size, max_context
        self.masks = MaskBuffer(vocab_size)
        self.mask_seconds = 0.0  # time spent computing and applying grammar masks, and the rows they covered
        self.masked_rows = 0

    def process(self, batch: ForwardBatch, logits: torch.Tensor) -> None:
        """Everything a forward's logits decide. The tokens it computed are in the KV cache now (a prefill's are
        published to the prefix cache, so a finished request leaves them there); rows that get a token are
        sampled; finished requests release their KV. `appended` counts the tokens this batch added."""
        self.appended = 0
        if batch.verifies:
            self._verify(batch, logits)
            return
        if batch.is_decode:
            for req in batch.reqs:
                req.kv_len += 1
        else:
            for req, n in zip(batch.reqs, batch.chunk_lens):
                req.kv_len += n
                self.kvm.publish(req)
        if batch.embed:
            self._pool(batch, logits)
            return
        rows = batch.sampled
        if not rows:
            return
        reqs = [batch.reqs[i] for i in rows]
        self.sample_and_append(reqs, logits if batch.is_decode else logits[rows])
        for req in reqs:
            if req.finished:
                self.kvm.release(req)

    def _verify(self, batch: ForwardBatch, logits: torch.Tensor) -> None:
        """A decode step that verified drafts (engine/speculative.py): row j of a request is sampled exactly as a
        decode step after its drafts 1..j would be (same processed logits, same seeded draw), and its tokens are
        kept while they equal the drafts. So the output is what speculation off would produce, seeded draws
        included, and the distribution of unseeded ones is the model's (a draft is kept with its probability).

        m tokens kept means rows 0..m-1 (the last token and drafts 1..m-1) wrote valid K/V; the rows after them
        give their slots back now."""
        views: list[_Row] = []
        for req, drafts in zip(batch.reqs, batch.drafts):
            biases = self._draft_masks(req, drafts) if req.matcher is not None else [None] * (len(drafts) + 1)
            views += [_Row(req, req.output_ids + list(drafts[:j]), biases[j]) for j in range(len(drafts) + 1)]
        drawn = self._draw(views, logits)
        now, start = time.monotonic(), 0
        for req, drafts in zip(batch.reqs, batch.drafts):
            kept = matched = 0
            for j in range(len(drafts) + 1):
                token, lp = drawn[start + j]
                self._append(req, token, lp, now)
                kept += 1
                matched += j < len(drafts) and token == drafts[j]
                if req.finished or j == len(drafts) or token != drafts[j]:
                    break
            req.kv_len += kept
            rejected = batch.out_slots[start + kept : start + len(drafts) + 1]
            if rejected.numel():
                self.kvm.kv.free(rejected)
            if drafts and self.speculator is not None:
                self.speculator.verified(req, len(drafts), matched)
            self.appended += kept
            start += len(drafts) + 1
            if req.finished:
                self.kvm.release(req)

    def _pool(self, batch: ForwardBatch, hidden: torch.Tensor) -> None:
        """An embedding prefill's forward returns every token's final hidden state: fold each request's rows into
        its pooled vector, and finish the requests whose prompt is complete."""
        start = 0
        for req, n, done in zip(batch.reqs, batch.chunk_lens, batch.completes):
            rows = hidden[start : start + n]
            start += n
            if req.pooling == "mean":
                part = rows.sum(0)
                req.pooled = part if req.pooled is None else req.pooled + part
            else:
                req.pooled = rows[-1]
            if done:
                vec = req.pooled / len(req.prompt_ids) if req.pooling == "mean" else req.pooled
                req.embedding = tuple(torch.nn.functional.normalize(vec, dim=0).tolist())
                req.first_token_at = req.first_token_at or time.monotonic()
                self.finish(req, "stop")
                self.kvm.release(req)

    def _banned(self, req: Request, num_output: int) -> tuple[int, ...]:
        if req.matcher is not None or num_output >= req.params.min_tokens:
            return ()
        eos = () if req.params.ignore_eos else tuple(self.eos)
        return eos + tuple(req.params.stop_token_ids)

    def _draft_masks(self, req: Request, drafts: tuple[int, ...]) -> list[torch.Tensor]:
        """The grammar's mask after each prefix of the drafts: the matcher steps through them and rolls back (the
        kept tokens are consumed again by `_append`). The drafts were cut to what the grammar accepts."""
        t0 = time.perf_counter()
        m = req.matcher
        biases = [self.masks.bias([m])[0]]
        for token in drafts:
            ok = m.consume_token(token)
            assert ok, "a draft the grammar rejects (Speculator.drafts cuts them)"
            biases.append(self.masks.bias([m])[0])
        m.rollback(len(drafts))
        self.mask_seconds += time.perf_counter() - t0
        return biases

    def sample_and_append(self, reqs: list[Request], logits: torch.Tensor) -> None:
        now = time.monotonic()
        for req, (token, lp) in zip(reqs, self._draw([_Row(r, r.output_ids) for r in reqs], logits)):
            self._append(req, token, lp, now)
        self.appended += len(reqs)

    def _draw(self, rows: list[_Row], logits: torch.Tensor) -> list[tuple[int, TokenLogprob | None]]:
        """The next token (and its logprob when asked) of each row: a request after `row.output_ids`."""
        logits = logits[:, : self.vocab_size]
        constrained = [i for i, r in enumerate(rows) if r.req.matcher is not None]
        if constrained:
            t0 = time.perf_counter()
            # Rows at their matcher's own state compute their masks here; draft rows brought theirs.
            live = [i for i in constrained if rows[i].bias is None]
            computed = iter(self.masks.bias([rows[i].req.matcher for i in live])) if live else iter(())
            bias = torch.stack([rows[i].bias if rows[i].bias is not None else next(computed) for i in constrained])
            apply_masks(logits, constrained, bias)
            self.mask_seconds += time.perf_counter() - t0
            self.masked_rows += len(constrained)
        banned = [self._banned(r.req, len(r.output_ids)) for r in rows]
        if not any(banned) and all(r.req.params.plain_greedy for r in rows):
            # The common serving case needs only the argmax: skip building the [B]-tensor sampling batch (its
            # dozen small tensors cost more than the argmax itself).
            return [(token, None) for token in argmax_rows(logits).tolist()]
        batch = SamplingBatch.build(
            [r.req.params for r in rows],
            [r.output_ids for r in rows],
            [r.req.prompt_ids for r in rows],
            [r.req.seed for r in rows],
            [len(r.output_ids) for r in rows],
            self.vocab_size,
            banned=banned,
        )
        result = sample(logits, batch)
        tokens = result.token_ids.tolist()
        lps = result.logprobs.tolist() if result.logprobs is not None else None
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        out: list[tuple[int, TokenLogprob | None]] = []
        for i, (row, token) in enumerate(zip(rows, tokens)):
            lp = None
            if row.req.params.logprobs and lps is not None:
                k = row.req.params.top_logprobs
                top = tuple(zip(top_ids[i][:k], top_lps[i][:k])) if k and top_ids and top_lps else ()
                lp = TokenLogprob(token, lps[i], top)
            out.append((token, lp))
        return out

    def _append(self, req: Request, token: int, lp: TokenLogprob | None, now: float) -> None:
        req.output_ids.append(token)
        req.pending_ids.append(token)
        if lp is not None:
            req.pending_logprobs.append(lp)
        req.first_token_at = req.first_token_at or now
        p = req.params
        if req.matcher is not None and not req.matcher.consume_token(token):
            # Cannot happen with the mask applied, short of a bug: never let a request run on off its grammar.
            log.error("request %s: token %d rejected by its grammar: %s", req.rid, token, req.matcher.get_error())
            self.finish(req, "abort")
            return
        if token in p.stop_token_ids:
            self.finish(req, "stop", token)
            return
        if token in self.eos and not p.ignore_eos:
            self.finish(req, "stop")
            return
        text, hit = req.stop.feed(req.detok.push([token]))
        req.pending_text += text
        if hit is not None:
            self.finish(req, "stop", hit, flush=False)
        elif req.matcher is not None and req.matcher.is_stopped():
            self.finish(req, "stop")
        elif len(req.output_ids) >= req.max_new_tokens or req.fill_len >= self.max_context:
            self.finish(req, "length")

    def finish(self, req: Request, reason: FinishReason, stop_reason: str | int | None = None,
               flush: bool = True) -> None:
        """Mark finished; release any text held back for a partial character or a possible stop string."""
        if flush:
            text, hit = req.stop.feed(req.detok.flush())
            req.pending_text += text
            if hit is None:
                req.pending_text += req.stop.flush()
            elif reason == "length":
                reason, stop_reason = "stop", hit
        req.status, req.finish_reason, req.stop_reason = ReqStatus.FINISHED, reason, stop_reason
        req.finished_at = time.monotonic()
        if self.speculator is not None:
            self.speculator.forget(req)


def take_output(req: Request) -> RequestOutput | None:
    """The request's staged output since the last call, or None when it has nothing new."""
    if not (req.pending_ids or req.pending_text or req.finished):
        return None
    metrics: dict[str, float] = {}
    if req.finished and req.finished_at is not None:
        metrics["e2e"] = req.finished_at - req.arrival
        if req.first_token_at is not None:
            metrics["ttft"] = req.first_token_at - req.arrival
        if req.admitted_at is not None:
            metrics["queue"] = req.admitted_at - req.arrival
    out = RequestOutput(
        request_id=req.request_id,
        index=req.index,
        token_ids=tuple(req.pending_ids),
        text=req.pending_text,
        logprobs=tuple(req.pending_logprobs) if req.params.logprobs else None,
        finish_reason=req.finish_reason,
        prompt_tokens=len(req.prompt_ids),
        completion_tokens=len(req.output_ids),
        stop_reason=req.stop_reason,
        cached_tokens=req.cached_tokens or 0,
        metrics=metrics,
        embedding=req.embedding,
        spec_proposed=req.spec.proposed if req.spec is not None else 0,
        spec_accepted=req.spec.accepted if req.spec is not None else 0,
    )
    req.pending_ids, req.pending_text, req.pending_logprobs = [], "", []
    return out
