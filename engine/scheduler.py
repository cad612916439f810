"""Continuous batching: admit within the KV budget, chunked prefill, decode, retract when the pool runs dry.

An engine step has three phases (engine/core.py EngineCore.step): `schedule()` decides the next forward, a prefill
batch or the running decode batch, as one ForwardBatch; the runner runs it; the output processor samples, checks
stops and releases KV (engine/output_processor.py); then `update()` moves requests between the queues. When both
have work, a decode step follows every `chunked_prefill_size` prompt tokens at most, and sooner when decode steps are cheap
next to the prefill (DECODE_SHARE), so a long prompt being prefilled in chunks never stalls the decode batch for
its whole length; prefill batches are small (PREFILL_BATCH_TOKENS), so of several prompts arriving together the
first gets its first token without waiting for the others.
With the prefix cache, admission maps the longest cached prefix of a prompt and prefills only the rest;
unused cache entries are evicted (LRU) before any request is retracted (engine/kv_manager.py).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.forward_batch import ForwardBatch, PrefillChunk
from engine.kv_manager import KVManager
from engine.output_processor import OutputProcessor
from engine.radix_cache import common_len
from engine.request import ReqStatus, Request
from engine.speculative import Speculator

log = logging.getLogger("ember.scheduler")

# SGLang's idea: reserve KV for the tokens running requests will still generate, scaled by a ratio that
# decays while decoding goes well and jumps back up when the pool runs dry and requests are retracted.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
CLIP_MAX_NEW_TOKENS = 4096
# A request whose prompt shares at least this many not-yet-cached tokens with one being prefilled waits for
# that prefill instead of computing the same tokens beside it (choices of one request wait for any overlap).
SHARED_PREFILL_MIN_TOKENS = 32
# A prefill batch takes no further request once it holds this many tokens. Prefill costs about the same per
# token from ~128 rows up (2.3-2.4 ms/token for SmolLM2 bf16 on 2 AVX2 cores at 128-1024 rows), so batching more
# prompts into one forward only delays the first of them: requests that arrive together get their first tokens
# one after another instead of all at the end.
PREFILL_BATCH_TOKENS = 128
# While prompts wait, a decode step runs once the prefill time since the last one reaches DECODE_SHARE times the
# last decode step's time (or chunked_prefill_size tokens, whichever comes first). With a small decode batch
# (cheap steps) that is after every prefill batch: streams keep flowing and requests that arrived together drift
# apart instead of finishing, and coming back, together (8 conversations sharing a system prompt: TTFT p50
# 1.3-1.5 s instead of 1.9-2.3 s with decode only every 512 tokens). With 32 requests decoding it is every few
# batches: a decode step after every 128-token batch cost 15 % of tokens/s at 32 clients. What remains is a
# trade: at 32 clients of 128-token prompts, 147 instead of 163 tok/s for TTFT p50 1.8 instead of 2.4 s.
DECODE_SHARE = 8.0


@dataclass
class SchedulerStats:
    retractions: int = 0
    aborted: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


class Scheduler:
    def __init__(self, kvm: KVManager, outputs: OutputProcessor, config: EngineConfig,
                 speculator: Speculator | None = None) -> None:
        self.kvm, self.outputs, self.config = kvm, outputs, config
        self.speculator = speculator
        self.req_pool = kvm.req_pool
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted; prompt (or recompute) partly in the cache
        self.running: list[Request] = []  # decode batch, in admission order
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.stats = SchedulerStats()
        self._prefill_since_decode = 0  # prompt tokens computed since the last decode step
        self._prefill_s_since_decode = 0.0  # and the seconds they took
        self._last_decode_s = 0.0
        self._touched: list[Request] = []  # changed outside a forward (retracted, or finished for want of KV)

    # ---- queue management -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def abort(self, request_id: str) -> list[Request]:
        """Finish every choice of `request_id` with reason abort, freeing its KV now."""
        hit = [r for r in (*self.waiting, *self.prefilling, *self.running) if r.request_id == request_id]
        for req in hit:
            self._remove(req)
            self.kvm.release(req)
            self.outputs.finish(req, "abort")
            self.stats.aborted += 1
        return hit

    # ---- one step: schedule, (the runner, the output processor), update ------------------------------
    def schedule(self) -> ForwardBatch | None:
        """The next forward: a prefill batch while prompts wait (a decode step between them as DECODE_SHARE and
        chunked_prefill_size say), else the running decode batch; None when nothing can run."""
        self.kvm.sync_windows([*self.prefilling, *self.running])
        want_prefill = bool(self.waiting or self.prefilling)
        decode_due = (self._prefill_since_decode >= self.config.chunked_prefill_size
                      or self._prefill_s_since_decode >= DECODE_SHARE * self._last_decode_s)
        if want_prefill and (not self.running or not decode_due):
            batch = self._schedule_prefill()
            if batch is not None:
                return batch
        self._prefill_since_decode, self._prefill_s_since_decode = 0, 0.0
        return self._schedule_decode() if self.running else None

    def update(self, batch: ForwardBatch, seconds: float) -> None:
        """After the output processor: requests whose prompt completed join the decode batch, finished ones leave
        their queue; `seconds` is what the forward and its outputs took."""
        if batch.is_decode:
            self._last_decode_s = seconds
            self.stats.decode_steps += 1
            self.stats.generation_tokens += self.outputs.appended
            if self.speculator is not None:
                self.speculator.planner.observe(batch.num_rows, seconds)
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
            self.running = [r for r in self.running if not r.finished]
            log.debug("decode %d requests, %d rows, %d tokens: %.1f ms", len(batch.reqs), batch.num_rows,
                      self.outputs.appended, seconds * 1e3)
            return
        self._prefill_s_since_decode += seconds
        self.stats.prefill_steps += 1
        tokens = sum(batch.chunk_lens)
        self._prefill_since_decode += tokens
        self.stats.prompt_tokens += tokens
        if batch.embed:  # finished (and released) by the output processor once their prompt is done
            for req, done in zip(batch.reqs, batch.completes):
                if done:
                    self.prefilling.remove(req)
        for i in batch.sampled:
            req = batch.reqs[i]
            self.prefilling.remove(req)
            self.stats.generation_tokens += 1
            if not req.finished:
                req.status = ReqStatus.RUNNING
                self.running.append(req)
        log.debug("prefill %d requests, %d tokens: %.1f ms (%d waiting, %d running)", len(batch.reqs), tokens,
                  seconds * 1e3, len(self.waiting), len(self.running))

    def take_touched(self) -> list[Request]:
        """Requests changed since the last call without a forward of theirs (retracted, finished for want of KV)."""
        touched, self._touched = self._touched, []
        return touched

    def _reserved(self) -> float:
        """KV slots promised to admitted requests beyond what they hold now."""
        total = 0.0
        for r in (*self.prefilling, *self.running):
            left = min(r.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS)
            total += left * self.new_token_ratio + (r.fill_len - r.kv_len if r in self.prefilling else 0)
        return total

    def _admit(self) -> None:
        """Move requests from the head of the queue into `prefilling` while their KV fits (FCFS, no skipping)."""
        while self.waiting and len(self.prefilling) + len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if self._awaits_shared_prefill(req):
                return
            row = self.req_pool.allocate()
            if row is None:
                return
            req.req_row = row
            cached = self.kvm.match(req)  # locks the prefix, so it is not counted as headroom below
            need_now = req.fill_len - cached
            need = need_now + min(req.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio
            # Nothing running means nothing will free up: admit anything that fits the pool at all.
            alone = not (self.prefilling or self.running)
            headroom = self.kvm.headroom()
            if (not alone and headroom - self._reserved() < need) or headroom < need_now:
                self.kvm.unmatch(req)
                self.req_pool.free(row)
                req.req_row = 0
                return
            self.waiting.popleft()
            req.kv_len, req.status = cached, ReqStatus.PREFILLING
            if req.cached_tokens is None:
                req.cached_tokens = min(cached, len(req.prompt_ids))
            req.admitted_at = req.admitted_at or time.monotonic()
            self.prefilling.append(req)

    def _awaits_shared_prefill(self, req: Request) -> bool:
        """True when a request being prefilled will cache tokens this one needs (see SHARED_PREFILL_MIN_TOKENS)."""
        if self.kvm.cache is None:
            return False
        want = req.all_ids[: req.fill_len - 1]
        for other in self.prefilling:
            # `other` has published its first kv_len tokens already; what it computes next is the gain.
            gain = common_len(other.all_ids[: other.fill_len], want) - other.kv_len
            if gain >= SHARED_PREFILL_MIN_TOKENS or (gain > 0 and other.request_id == req.request_id):
                return True
        return False

    def _schedule_prefill(self) -> ForwardBatch | None:
        self._admit()
        # With a decode batch waiting, at most chunked_prefill_size prompt tokens run between two decode steps.
        budget = self.config.chunked_prefill_size - (self._prefill_since_decode if self.running else 0)
        chunks: list[PrefillChunk] = []
        members: list[Request] = []
        taken = 0
        for req in self.prefilling:
            if taken >= PREFILL_BATCH_TOKENS:
                break
            if members and (req.pooling is None) != (members[0].pooling is None):
                break  # embedding prefills return hidden states, not logits: a batch holds one kind
            take = min(budget - taken, req.fill_len - req.kv_len)
            if take <= 0:
                break
            slots = self.kvm.allocate(take)
            if slots is None:
                break
            chunks.append(PrefillChunk(req.req_row, req.kv_len, req.all_ids[req.kv_len : req.kv_len + take], slots,
                                       req.fill_len))
            members.append(req)
            taken += take
        if not chunks:
            return None
        completes = tuple(c.prefix_len + len(c.token_ids) == r.fill_len for c, r in zip(chunks, members))
        return ForwardBatch.prefill(chunks, tuple(members), completes, embed=members[0].pooling is not None)

    def _schedule_decode(self) -> ForwardBatch | None:
        while self.kvm.headroom() < len(self.running):
            if self.prefilling:  # half-prefilled requests give their slots back first
                self._touched.append(self._retract(self.prefilling[-1]))
                continue
            if len(self.running) == 1:  # alone and the pool is full: it can never continue
                req = self.running.pop()
                self.kvm.release(req)
                self.outputs.finish(req, "length")
                self._touched.append(req)
                return None
            self._touched.append(self._retract(self.running[-1]))
        batch = self.running
        drafts: list[tuple[int, ...]] = [()] * len(batch)
        if self.speculator is not None:
            room = min(self.kvm.headroom(), self.config.buckets[-1]) - len(batch)
            drafts = self.speculator.drafts(batch, room)
        # Each request's last token and its drafts (if any): consecutive rows on its own request row.
        ids: list[int] = []
        pos: list[int] = []
        rows: list[int] = []
        for r, d in zip(batch, drafts):
            ids += [r.output_ids[-1], *d]
            pos += range(r.fill_len - 1, r.fill_len + len(d))
            rows += [r.req_row] * (1 + len(d))
        slots = self.kvm.allocate(len(ids))
        assert slots is not None  # ensured by the loop above; the drafts were fitted to the headroom
        positions = torch.tensor(pos, dtype=torch.int64)
        return ForwardBatch.decode(
            input_ids=torch.tensor(ids, dtype=torch.int64), positions=positions,
            req_rows=torch.tensor(rows, dtype=torch.int64), seq_lens=positions + 1, out_slots=slots,
            reqs=tuple(batch), drafts=tuple(drafts) if any(drafts) else ())

    # ---- KV bookkeeping -------------------------------------------------------------------------------
    def _retract(self, req: Request) -> Request:
        """Free the newest request's KV and requeue it at the head; it is recomputed from its tokens later."""
        self._remove(req)
        self.kvm.release(req)
        req.pooled = None  # an embedding's partial sum: its prompt is recomputed from the start
        req.status = ReqStatus.WAITING
        self.waiting.appendleft(req)
        self.stats.retractions += 1
        self.new_token_ratio = max(self.new_token_ratio, 0.9)
        return req

    def _remove(self, req: Request) -> None:
        for queue in (self.prefilling, self.running):
            if req in queue:
                queue.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)

    def flush_cache(self) -> int:
        """Drop every prefix-cache entry no admitted request uses; returns the KV slots freed."""
        return self.kvm.flush()
