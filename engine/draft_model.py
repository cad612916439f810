"""A draft model: a small model with the target's tokenizer proposes each request's next k tokens by its own greedy
decode, and the target verifies them in its decode step (engine/speculative.py) like any other drafts.

The draft runs in a ModelRunner of its own (its own request table, token pool and compiled decode buckets), so it
follows the target's batch with the same machinery. Per request it keeps the K/V of a prefix of the request's
tokens (`valid`): a draft round first feeds what the draft has not seen (the target's bonus token, and the last
accepted draft when all were accepted; a new or long-idle request's whole prompt through an eager prefill), then
feeds its own drafts one step at a time. The drafts it fed become valid K/V where the target accepted them, which
the next round finds by comparing them with the request's tokens, so nothing is recomputed after a good round.
Positions keep their slots for the request's life (a rejected draft's slot is overwritten by the next token
there); the slots go back when the request finishes, or when the pool needs room and the request is not drafting.

Proposals are the draft's argmax, a point mass, so the target's rule for a proposed token (keep it with the
target's probability of it, else resample the rest) leaves the output distribution unchanged.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.forward_batch import ForwardBatch, PrefillChunk
from engine.loader import resolve_model_path
from engine.loader.prepared import PreparedModel, open_cached, tokenizer_cached
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.speculative import ema

log = logging.getLogger("ember.draft")

_T = TypeVar("_T")  # what an allocator hands out: a request row, or slots


@dataclass
class _DraftState:
    row: int  # the request's row of the draft's request table
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))  # position -> slot
    valid: int = 0  # request tokens [0, valid) have their K/V in the draft's pool
    fed: list[int] = field(default_factory=list)  # drafts fed at positions valid, valid + 1, .. in the last round


class DraftModel:
    """The draft runner and every drafting request's state in it (engine thread only)."""

    def __init__(self, config: EngineConfig, target_slots: int, target_vocab: int,
                 tokenizer: PreTrainedTokenizerBase, on_bucket: Callable[[int, float], None] | None = None) -> None:
        """on_bucket: called as each of the draft's decode buckets becomes ready (the engine republishes its stats)."""
        assert config.draft_model is not None
        rows = config.max_running_requests
        # The draft holds tokens of running requests only, never a cache: as many as the target's pool plus each
        # request's speculative positions covers every batch the target can run (requests sharing a cached prefix
        # each hold their own copy here; the pool then evicts idle requests' K/V, and a request it cannot fit does
        # not draft that step).
        slots = target_slots + rows * (config.num_speculative_tokens + 1)
        # The prefix cache flag only decides where window layers keep K/V: a slot per position (not rings), so a
        # request's catch-up and draft rows can share a step; as many window slots as pool slots, since nothing here
        # gives window slots back early (engine/window_keeper.py runs for the target's pool only).
        self.config = dataclasses.replace(config, model=config.draft_model, draft_model=None, speculative="off",
                                          max_total_tokens=slots, kv_disk_cache_size=0, disable_prefix_cache=False,
                                          window_kv_ratio=1.0)
        path = resolve_model_path(config.draft_model)
        prepared = PreparedModel(config.compile_cache_dir, path) if config.compile_cache_dir else None
        checkpoint = open_cached(config.draft_model, prepared)
        check_tokenizers(tokenizer, tokenizer_cached(config.draft_model, prepared), config.draft_model)
        self.runner = ModelRunner(self.config, checkpoint, on_bucket, prepared)
        log.info("draft model %s: %d KV slots (%.2f GiB), drafts up to %d tokens a step", config.draft_model, slots,
                 slots * self.runner.kv_bytes_per_token / 2**30, config.num_speculative_tokens)
        self.vocab = min(target_vocab, self.runner.model_config.vocab_size)
        self.max_context = self.runner.max_context
        self.states: dict[Request, _DraftState] = {}
        # Unseen tokens of a request beyond this many are prefilled (eagerly, in chunks) before the decode-row
        # catch-up, whose rows go through the compiled buckets: a request back from a while without drafting
        # catches up in one compiled step.
        self.catchup_rows = self.runner.graphs.max_batch
        # EMA seconds of a round's catch-up (its first forward, and any prefill before it) and of each later draft
        # forward: a request that has not drafted for a while has more to catch up, and the planner must count it.
        self.catchup_s: float | None = None
        self.step_s: float | None = None

    # ---- the planner's view ---------------------------------------------------------------------------------
    def room(self, req: Request) -> int:
        """Most drafts the draft's context leaves for `req` this step."""
        return max(0, self.max_context - req.fill_len)

    def cost(self, longest: int) -> float:
        """Seconds of a draft round whose longest draft is `longest` tokens: the catch-up forward, then one forward
        per further token. Nothing measured yet: free, so the first round runs and is measured."""
        if longest <= 0 or self.catchup_s is None:
            return 0.0
        return self.catchup_s + (longest - 1) * (self.step_s if self.step_s is not None else self.catchup_s)

    # ---- drafting ---------------------------------------------------------------------------------------------
    def propose(self, batch: Sequence[Request], lengths: Sequence[int]) -> list[tuple[int, ...]]:
        """Up to lengths[i] greedy draft tokens of the draft model for each request of the batch."""
        drafting = {r for r, k in zip(batch, lengths) if k > 0}
        active: list[tuple[Request, int, _DraftState, list[int]]] = []  # (the request's tokens, made once)
        for req, k in zip(batch, lengths):
            if k > 0:
                ids = req.all_ids
                st = self._state(req, ids, k, drafting)
                if st is not None:
                    active.append((req, k, st, ids))
        out: dict[Request, list[int]] = {req: [] for req in batch}
        if not active:
            return [()] * len(batch)
        t0 = time.perf_counter()
        self._catch_up([(req, st, ids) for req, _, st, ids in active], out)
        t1 = time.perf_counter()
        self.catchup_s = ema(self.catchup_s, t1 - t0)
        longest = max(k for _, k, _, _ in active)
        for j in range(1, longest):  # draft j + 1 from draft j, at position valid + j - 1
            step = [(req, st) for req, k, st, _ in active if k > j]
            ids = [out[req][-1] for req, _ in step]
            logits = self._decode(ids, [st.valid + j - 1 for _, st in step], [st for _, st in step])
            for (req, st), fed, tok in zip(step, ids, self._argmax(logits)):
                st.fed.append(fed)
                out[req].append(tok)
        if longest > 1:
            self.step_s = ema(self.step_s, (time.perf_counter() - t1) / (longest - 1))
        return [tuple(out[req]) for req in batch]

    def release(self, req: Request) -> None:
        """Give back a finished request's draft row and slots."""
        st = self.states.pop(req, None)
        if st is not None:
            self.runner.kv_pool.free(st.slots)
            self.runner.req_pool.free(st.row)

    def _state(self, req: Request, ids: list[int], k: int, drafting: set[Request]) -> _DraftState | None:
        """The request's draft state with slots for every position this round writes (up to fill_len - 1 + k - 1),
        its previous round's drafts checked against the tokens since; None when the pool cannot hold it."""
        st = self.states.get(req)
        if st is None:
            row = self._make_room(lambda: self.runner.req_pool.allocate(), drafting)
            if row is None:
                return None
            st = self.states[req] = _DraftState(row)
        keep = 0
        while keep < len(st.fed) and st.valid + keep < len(ids) - 1 and ids[st.valid + keep] == st.fed[keep]:
            keep += 1  # (the last token is always fed again: its logits give the first draft)
        st.valid, st.fed = min(st.valid + keep, len(ids) - 1), []
        need = len(ids) + k - 1 - st.slots.numel()
        if need > 0:
            more = self._make_room(lambda: self.runner.kv_pool.allocate(need), drafting)
            if more is None:
                self.release(req)
                return None
            st.slots = torch.cat([st.slots, more])
        return st

    def _make_room(self, take: Callable[[], _T | None], drafting: set[Request]) -> _T | None:
        """take(), evicting the states of requests not drafting this step until it succeeds (or none is left)."""
        got = take()
        idle = [r for r in self.states if r not in drafting]
        while got is None and idle:
            self.release(idle.pop(0))
            got = take()
        return got

    def _catch_up(self, active: list[tuple[Request, _DraftState, list[int]]], out: dict[Request, list[int]]) -> None:
        """Feed every token each request has (`ids`) that the draft has not seen; the last one's logits are draft 1."""
        rows = self.catchup_rows
        long = [(st, ids) for _, st, ids in active if len(ids) - st.valid > rows]
        chunk = self.config.chunked_prefill_size
        while long:  # eager prefill up to the last `rows` tokens, chunk by chunk across requests
            chunks, budget = [], chunk
            for st, ids in long:
                take = min(len(ids) - rows - st.valid, budget)
                if take <= 0:
                    break
                chunks.append((st, ids[st.valid : st.valid + take]))
                budget -= take
            if not chunks:
                break
            self.runner.forward(ForwardBatch.prefill(
                [PrefillChunk(st.row, st.valid, toks, st.slots[st.valid : st.valid + len(toks)])
                 for st, toks in chunks]))
            for st, toks in chunks:
                st.valid += len(toks)
            long = [(st, ids) for st, ids in long if len(ids) - st.valid > rows]
        feed: list[int] = []
        pos: list[int] = []
        sts: list[_DraftState] = []
        last: list[int] = []
        for _, st, ids in active:
            toks = ids[st.valid :]
            feed += toks
            pos += range(st.valid, st.valid + len(toks))
            sts += [st] * len(toks)
            last.append(len(feed) - 1)
        logits = self._decode(feed, pos, sts)
        for (req, st, ids), tok in zip(active, self._argmax(logits[last])):
            st.valid = len(ids)
            out[req].append(tok)

    def _decode(self, ids: list[int], pos: list[int], states: list[_DraftState]) -> torch.Tensor:
        """Logits of decode rows (token ids[i] at position pos[i] of states[i]'s request), in forwards of at most
        the largest bucket's rows; a request's rows are in position order, so a later forward sees the K/V an
        earlier one wrote."""
        positions = torch.tensor(pos, dtype=torch.int64)
        slots = torch.stack([st.slots[p] for st, p in zip(states, pos)])
        rows = torch.tensor([st.row for st in states], dtype=torch.int64)
        tokens = torch.tensor(ids, dtype=torch.int64)
        step, parts = self.runner.graphs.max_batch, []
        for i in range(0, len(ids), step):
            parts.append(self.runner.forward(ForwardBatch.decode(tokens[i : i + step], positions[i : i + step],
                                                                 rows[i : i + step], slots[i : i + step])))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _argmax(self, logits: torch.Tensor) -> list[int]:
        return logits[:, : self.vocab].argmax(dim=-1).tolist()

    def stop(self) -> None:
        """Stop compiling the draft's decode buckets (engine shutdown)."""
        self.runner.graphs.stop(0)


def check_tokenizers(target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase, draft_path: str) -> None:
    """A draft proposes token ids: they must mean the same text in both models."""
    if target.get_vocab() != draft.get_vocab():
        raise ValueError(f"--draft-model {draft_path} has a different tokenizer from the model's: its token ids "
                         "would mean other text (a draft model must share the model's vocabulary)")

