"""Continuous batching: admit within the KV budget, chunked prefill, decode, retract when the pool runs dry.

Each `step()` runs one forward: a prefill (extend) batch or the running decode batch. When both have work, a
decode step follows every `chunked_prefill_size` prompt tokens at most, and sooner when decode steps are cheap
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
from engine.kv_manager import KVManager
from engine.radix_cache import common_len
from engine.model_runner import ExtendChunk, ModelRunner
from engine.request import ReqStatus, Request
from engine.result_processor import ResultProcessor

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
    def __init__(self, runner: ModelRunner, results: ResultProcessor, config: EngineConfig) -> None:
        self.runner, self.results, self.config = runner, results, config
        self.req_pool = runner.req_pool
        # Sliding-window layers keep only each request's last window of K/V (engine/pools.py WindowKVPool), so a
        # cached prefix would lack their part of it: such models recompute every prompt (README, "Sliding windows").
        prefix_cache = not config.disable_prefix_cache and runner.window_pool is None
        self.kvm = KVManager(runner.kv_pool, self.req_pool, prefix_cache=prefix_cache)
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted; prompt (or recompute) partly in the cache
        self.running: list[Request] = []  # decode batch, in admission order
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.stats = SchedulerStats()
        self._prefill_since_decode = 0  # prompt tokens computed since the last decode step
        self._prefill_s_since_decode = 0.0  # and the seconds they took
        self._last_decode_s = 0.0

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
            self.results.finish(req, "abort")
            self.stats.aborted += 1
        return hit

    # ---- one step -----------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one forward; return the requests that have new output (finished ones included)."""
        t0 = time.perf_counter()
        want_prefill = bool(self.waiting or self.prefilling)
        decode_due = (self._prefill_since_decode >= self.config.chunked_prefill_size
                      or self._prefill_s_since_decode >= DECODE_SHARE * self._last_decode_s)
        if want_prefill and (not self.running or not decode_due):
            before = self.stats.prompt_tokens
            touched = self._prefill_step()
            if touched is not None:
                self._prefill_s_since_decode += time.perf_counter() - t0
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("prefill %d requests, %d tokens: %.1f ms (%d waiting, %d running)", len(touched),
                              self.stats.prompt_tokens - before, (time.perf_counter() - t0) * 1e3,
                              len(self.waiting), len(self.running))
                return touched
        self._prefill_since_decode, self._prefill_s_since_decode = 0, 0.0
        if not self.running:
            return []
        t1 = time.perf_counter()
        touched = self._decode_step()
        self._last_decode_s = time.perf_counter() - t1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("decode %d requests: %.1f ms", len(touched), (time.perf_counter() - t0) * 1e3)
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

    def _prefill_step(self) -> list[Request] | None:
        self._admit()
        # With a decode batch waiting, at most chunked_prefill_size prompt tokens run between two decode steps.
        budget = self.config.chunked_prefill_size - (self._prefill_since_decode if self.running else 0)
        chunks: list[ExtendChunk] = []
        members: list[Request] = []
        taken = 0
        for req in self.prefilling:
            if taken >= PREFILL_BATCH_TOKENS:
                break
            take = min(budget - taken, req.fill_len - req.kv_len)
            if take <= 0:
                break
            slots = self.kvm.allocate(take)
            if slots is None:
                break
            chunks.append(ExtendChunk(req.req_row, req.kv_len, req.all_ids[req.kv_len : req.kv_len + take], slots,
                                      req.fill_len))
            members.append(req)
            taken += take
        if not chunks:
            return None
        logits = self.runner.extend(chunks)
        self.stats.prefill_steps += 1
        done_idx = []
        for i, (req, chunk) in enumerate(zip(members, chunks)):
            req.kv_len += len(chunk.token_ids)
            self._prefill_since_decode += len(chunk.token_ids)
            self.kvm.publish(req)
            self.stats.prompt_tokens += len(chunk.token_ids)
            if req.kv_len == req.fill_len:
                done_idx.append(i)
        done = [members[i] for i in done_idx]
        if done:
            self.results.sample_and_append(done, logits[done_idx])
            for req in done:
                self.prefilling.remove(req)
                if req.finished:
                    self.kvm.release(req)
                else:
                    req.status = ReqStatus.RUNNING
                    self.running.append(req)
        self.stats.generation_tokens += len(done)
        return members

    def _decode_step(self) -> list[Request]:
        touched: list[Request] = []
        while self.kvm.headroom() < len(self.running):
            if self.prefilling:  # half-prefilled requests give their slots back first
                touched.append(self._retract(self.prefilling[-1]))
                continue
            if len(self.running) == 1:  # alone and the pool is full: it can never continue
                req = self.running.pop()
                self.kvm.release(req)
                self.results.finish(req, "length")
                return [req]
            touched.append(self._retract(self.running[-1]))
        batch = self.running
        slots = self.kvm.allocate(len(batch))
        assert slots is not None  # ensured by the loop above
        rows = torch.tensor([r.req_row for r in batch], dtype=torch.int64)
        positions = torch.tensor([r.fill_len - 1 for r in batch], dtype=torch.int64)
        ids = torch.tensor([r.output_ids[-1] for r in batch], dtype=torch.int64)
        logits = self.runner.decode(rows, positions, ids, slots)
        self.stats.decode_steps += 1
        self.stats.generation_tokens += len(batch)
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        for req in batch:
            req.kv_len += 1
        self.results.sample_and_append(batch, logits)
        self.running = [r for r in batch if not r.finished]
        for req in batch:
            if req.finished:
                self.kvm.release(req)
        return touched + batch

    # ---- KV bookkeeping -------------------------------------------------------------------------------
    def _retract(self, req: Request) -> Request:
        """Free the newest request's KV and requeue it at the head; it is recomputed from its tokens later."""
        self._remove(req)
        self.kvm.release(req)
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
