"""Speculative decoding by prompt lookup (n-gram drafts) or a draft model (engine/draft_model.py), verified for the
whole decode batch in one forward.

A decode step reads every weight once for one token per request; at small batch that pass is memory-bound, so
checking k proposed tokens in the same pass costs little more than one. Each running request proposes the
continuation of the latest earlier occurrence of its last n tokens in its own prompt and output (n from MAX_NGRAM
down to MIN_NGRAM; no second model, no extra memory beyond an index of its n-grams).

Verification is an ordinary compiled decode step: request r contributes rows for its last token and its k drafts
at positions L-1 .. L-1+k, all on r's request-to-token row, each with sequence length position + 1. The attention
op writes every row's K/V before any row attends (engine/ops/attention.py), so row j sees exactly the request's
context plus drafts 1..j: causal attention over drafts with no op of its own. The output processor samples each
row as the decode step at that position would and keeps tokens while they match the drafts
(engine/output_processor.py `process_verify`).

Whether drafting pays is decided per step (`DraftPlanner`): the measured seconds of a decode step in each bucket
and each request's recent acceptance rate give the expected tokens per second of every draft length; the planner
takes the most. Padding rows of a bucket are free drafts; at high batch a bigger bucket rarely pays, so the
planner drafts less or not at all, and a request whose drafts keep failing stops drafting (and probes again later).
"""
from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.request import Request
from engine.suffix_index import MATCH_CAP, SharedIndex, common_suffix


MIN_NGRAM, MAX_NGRAM = 2, 4
# How well a proposal's source matched says more about whether its drafts are kept than the request does: in
# greedy outputs of the default model (scripts/replay_spec.py) a draft after a fresh 2-token match was kept at
# 0.73-0.84 a token, one that continues a source matching 8 tokens and more (a copy in progress, a loop) at
# 0.95-1.0. So each request keeps a rate per class of matched length (class i: at least MATCH_CLASSES[i] tokens;
# a draft model's drafts are all class 0), each starting from its prior: where a copy is under way, even a batch
# of 8 whose 16-row step costs 1.8x an 8-row one drafts from the start.
MATCH_CLASSES = (0, 3, MATCH_CAP)
CLASS_PRIORS = (0.5, 0.7, 0.9)  # acceptance rate assumed before a request has verified any draft of the class
RATE_EMA = 0.3  # weight of the latest verify step in a request's acceptance rate
# Per step without drafting, a request's rate relaxes this far toward the prior, so one that stopped drafting
# tries again after a while (its text may have started quoting its prompt).
RATE_RECOVERY = 0.02
# A draft model's probe is not free (a catch-up forward and the draft's own steps): it probes less often.
DRAFT_RATE_RECOVERY = 0.005
# Weight of a verify step in the all-requests acceptance rate a new request starts at: on a workload that copies
# (edits, quotes) it drafts from its first step, where at the prior a batch of 8 would never try (on a model whose
# 16-row step costs 1.5-1.8x an 8-row one, one draft a request at 0.5 does not pay), and on free text it starts low.
RECENT_RATE_EMA = 0.1
MAX_RATE = 0.95  # an estimate, never a certainty: keeps the expected gain of long drafts finite
STEP_TIME_EMA = 0.2  # (a draft model's own step time: engine/draft_model.py)
# A bucket's step cost is the median of its last STEP_SAMPLES steps: a served step now and then costs 2-3x its usual
# (the server's threads, a collection), and an average pulled up by one would keep the planner out of that bucket
# for many steps. In a replay of the 8-client edit workload (scripts/replay_spec.py) with 5 % of steps observed at
# 1.25-3.75x their cost, an EMA of weight 0.2 planned 1.26-1.30x speculation off's tok/s, the median 1.31-1.35x
# (1.33-1.34x for both without the outliers).
STEP_SAMPLES = 15


class NgramIndex:
    """The latest occurrence of every n-gram of one request's tokens that has a token after it, and where the last
    proposal came from.

    Copying text (an edit, a quote) continues where the previous draft left off, while a short n-gram of code
    or prose recurs in many places: so a proposal first follows on from the previous proposal's source while the
    tokens since then still match it, and only looks up the longest suffix n-gram when that thread is broken."""

    def __init__(self) -> None:
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(MIN_NGRAM, MAX_NGRAM + 1)}
        self.indexed = 0  # n-grams ending (exclusive) at positions <= indexed are in the maps
        self.source = -1  # ids[source] was the first token of the last proposal, made when there were `at` ids
        self.at = 0
        self.matched = 0  # tokens before the last proposal's source that equal the suffix (up to MATCH_CAP)

    def propose(self, ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the current suffix of `ids` earlier in `ids`."""
        n_ids, last = len(ids), len(ids) - 1  # an n-gram ending at e (exclusive) <= last has a follower ids[e]
        for end in range(self.indexed + 1, last + 1):
            for n, m in self.maps.items():
                if end >= n:
                    m[tuple(ids[end - n : end])] = end
        self.indexed = max(self.indexed, last)
        # The thread from the last proposal, kept when it matches the suffix at least as long as the best lookup.
        thread = self.source + (n_ids - self.at) if self.source >= 0 else -1
        thread_len = common_suffix(ids, thread, ids) if 0 < thread < n_ids else 0
        start = thread if thread_len >= MIN_NGRAM else -1
        for n in range(min(MAX_NGRAM, n_ids), max(thread_len, MIN_NGRAM - 1), -1):
            end = self.maps[n].get(tuple(ids[n_ids - n :]))
            if end is not None:
                start = end
                break
        self.source, self.at = start, n_ids
        self.matched = thread_len if start == thread else common_suffix(ids, start, ids) if start >= 0 else 0
        if start < 0:
            return []
        # A source that runs into the end of ids is a repeat of period n_ids - start (text in a loop, a list's
        # pattern): the proposal goes on around the loop rather than stopping where ids do.
        period = n_ids - start
        return [ids[start + i % period] for i in range(k)] if period < k else list(ids[start : start + k])


def match_class(matched: int) -> int:
    """The rate class of a proposal whose source matched `matched` tokens of the suffix."""
    return bisect.bisect_right(MATCH_CLASSES, matched) - 1


@dataclass
class SpecState:
    """One request's drafting state (engine thread only). Retraction keeps it: the tokens it indexes stay.

    `rates[c]` estimates the chance that a draft token of match class c (MATCH_CLASSES) is kept given that every
    draft before it was: the planner's model (DraftPlanner.plan). A verify step that kept a of k drafts tested a + 1
    of them (the first rejected one ended it) or, when all were kept, k: so the estimate is kept tokens over tested
    ones, both as moving sums over the class's recent verify steps. (Kept over proposed, a / k, would read 7 drafts
    of which 4 were kept as 0.57 where the per-token rate is 0.8, and make long drafts look worse the longer they
    get.) `cls` is the class of the proposal made this step, which its verify step records."""

    index: NgramIndex = field(default_factory=NgramIndex)
    rates: list[float] = field(default_factory=lambda: list(CLASS_PRIORS))
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of which were accepted
    verify_steps: int = 0  # steps in which the request verified at least one draft
    recovery: float = RATE_RECOVERY
    tested: list[float] = field(default_factory=lambda: [1.0] * len(CLASS_PRIORS))  # moving sums of tested drafts
    cls: int = 0

    @property
    def rate(self) -> float:
        """The rate of this step's proposal's class."""
        return self.rates[self.cls]

    def record(self, proposed: int, accepted: int) -> None:
        if proposed:
            c = self.cls
            kept = (1 - RATE_EMA) * self.rates[c] * self.tested[c] + RATE_EMA * accepted
            self.tested[c] = (1 - RATE_EMA) * self.tested[c] + RATE_EMA * tested_drafts(proposed, accepted)
            self.rates[c] = kept / self.tested[c]
            self.proposed += proposed
            self.accepted += accepted
            self.verify_steps += 1
        else:
            self.rates = [r + (p - r) * self.recovery for r, p in zip(self.rates, CLASS_PRIORS)]


def tested_drafts(proposed: int, accepted: int) -> int:
    """Draft tokens a verify step tested: the kept ones, and the first rejected one if any."""
    return accepted + (accepted < proposed)


@dataclass
class SpecStats:
    proposed: int = 0
    accepted: int = 0
    verify_steps: int = 0  # request-steps that verified at least one draft


class DraftPlanner:
    """Chooses each request's draft length for one decode step from measured step times and acceptance rates."""

    def __init__(self, buckets: Sequence[int], ready: Callable[[int], bool]) -> None:
        self.buckets = tuple(sorted(buckets))
        self.ready = ready  # whether a bucket's compiled step is in (eager steps cost far more: never draft into one)
        self.step_s: dict[int, float] = {}  # bucket -> seconds of a decode step (forward and outputs): see STEP_SAMPLES
        self._samples: dict[int, deque[float]] = {}

    def bucket(self, rows: int) -> int | None:
        i = bisect.bisect_left(self.buckets, rows)
        return self.buckets[i] if i < len(self.buckets) else None

    def observe(self, rows: int, seconds: float) -> None:
        b = self.bucket(rows)
        if b is not None:
            recent = self._samples.setdefault(b, deque(maxlen=STEP_SAMPLES))
            recent.append(seconds)
            self.step_s[b] = statistics.median(recent)

    def cost(self, rows: int) -> float | None:
        """Seconds of a step of `rows` rows: measured for its bucket, else (to explore it once) that of the largest
        measured smaller bucket; None when its bucket is not ready or nothing is measured yet."""
        b = self.bucket(rows)
        if b is None or not self.ready(b):
            return None
        if b in self.step_s:
            return self.step_s[b]
        below = [c for c in self.step_s if c < b]
        return self.step_s[max(below)] if below else None

    def plan(self, rates: Sequence[float], proposals: Sequence[int], budget: int,
             draft_cost: Callable[[int], float] | None = None) -> list[int]:
        """Draft lengths (at most proposals[i], in all at most `budget`) that maximise expected tokens per second.

        Draft j of request i is accepted with probability rate_i ** j (all before it must be), so the expected
        tokens of a step are sum_i sum_{j <= k_i} rate_i ** j. Adding drafts in order of that gain and keeping the
        best prefix finds the optimum, since each request's gains fall with j. draft_cost(longest): seconds the
        drafter spends on a round whose longest draft has that many tokens (a draft model; n-gram drafts are free)."""
        base = len(rates)
        best_cost = self.cost(base)
        if best_cost is None or budget <= 0:
            return [0] * base
        gains = sorted(((min(r, MAX_RATE) ** j, i) for i, r in enumerate(rates) for j in range(1, proposals[i] + 1)),
                       key=lambda g: -g[0])
        tokens, best_value, best_n = float(base), base / best_cost, 0
        taken, longest = [0] * base, 0
        for n, (gain, i) in enumerate(gains[:budget], start=1):
            tokens += gain
            taken[i] += 1
            longest = max(longest, taken[i])
            cost = self.cost(base + n)
            if cost is None:
                break
            if draft_cost is not None:
                cost += draft_cost(longest)
            if tokens / cost > best_value:
                best_value, best_n = tokens / cost, n
        lengths = [0] * base
        for _, i in gains[:best_n]:
            lengths[i] += 1
        return lengths


class Drafter(Protocol):
    """What the Speculator needs of a model that writes drafts (engine/draft_model.py DraftModel)."""

    def room(self, req: Request) -> int: ...  # most drafts the drafter can write for req this step
    def cost(self, longest: int) -> float: ...  # seconds of a round whose longest draft has that many tokens
    def propose(self, batch: Sequence[Request], lengths: Sequence[int]) -> list[tuple[int, ...]]: ...
    def release(self, req: Request) -> None: ...  # req finished: its state goes
    def stop(self) -> None: ...  # engine shutdown


class Speculator:
    """The scheduler's view of speculation: proposals and draft lengths for a decode batch, and what came of them.
    With a draft model (engine/draft_model.py) the lengths are planned first, from each request's room and the
    draft's measured cost per token, and the draft then writes that many; n-gram proposals are looked up first
    and cost nothing."""

    def __init__(self, buckets: Sequence[int], ready: Callable[[int], bool], max_draft: int,
                 drafter: Drafter | None = None, share: bool = True) -> None:
        """share: n-gram drafts may also come from finished requests' text (engine/suffix_index.py)."""
        self.planner = DraftPlanner(buckets, ready)
        self.max_draft = max_draft
        self.drafter = drafter
        self.shared = SharedIndex() if drafter is None and share else None
        self.stats = SpecStats()
        # Per match class, an EMA of every verify step's acceptance rate, all requests together.
        self.recent_rates = list(CLASS_PRIORS)

    def drafts(self, batch: Sequence[Request], budget: int) -> list[tuple[int, ...]]:
        """Each request's drafts for this step (empty: it decodes one token). A grammar-constrained request's
        proposal is cut where its grammar would reject a token: a draft the mask forbids could never be kept."""
        if budget <= 0:  # no row to draft into (a full largest bucket, a full pool): skip the lookups this step
            return self._no_drafts(batch)
        rooms: list[int] = []
        for req in batch:
            if req.spec is None:  # a new request starts from the acceptance drafts have had lately
                req.spec = SpecState(rates=list(self.recent_rates),
                                     recovery=RATE_RECOVERY if self.drafter is None else DRAFT_RATE_RECOVERY)
            room = min(self.max_draft, req.max_new_tokens - len(req.output_ids) - 1)  # the step adds one of its own
            rooms.append(max(0, room if self.drafter is None else min(room, self.drafter.room(req))))
        if self.drafter is None:
            proposals = [_grammar_cut(req, self._lookup(req, room)) if room > 0 else ()
                         for req, room in zip(batch, rooms)]
            if not any(proposals):
                return self._no_drafts(batch)
            rates = [req.spec.rate if req.spec is not None else 0.0 for req in batch]
            lengths = self.planner.plan(rates, [len(p) for p in proposals], budget)
            out = [tuple(p[:k]) for p, k in zip(proposals, lengths)]
        else:
            rates = [req.spec.rate if req.spec is not None else 0.0 for req in batch]
            lengths = self.planner.plan(rates, rooms, budget, self.drafter.cost)
            if not any(lengths):
                return self._no_drafts(batch)
            out = [_grammar_cut(req, d) for req, d in zip(batch, self.drafter.propose(batch, lengths))]
        for req, d in zip(batch, out):
            if req.spec is not None and not d:
                req.spec.record(0, 0)
        return out

    def _lookup(self, req: Request, k: int) -> list[int]:
        """An n-gram proposal: from the request's own text, else from other requests' (engine/suffix_index.py)."""
        assert req.spec is not None
        ids = req.all_ids
        own = req.spec.index.propose(ids, k)
        if own or self.shared is None:
            req.spec.cls = match_class(req.spec.index.matched)
            return own
        shared = self.shared.propose(ids, k)
        req.spec.cls = match_class(self.shared.matched)
        return shared

    def forget(self, req: Request) -> None:
        """A request finished: the drafter's state of it goes, and (n-grams) its text joins the shared index."""
        if self.drafter is not None:
            self.drafter.release(req)
        elif self.shared is not None and req.pooling is None and req.output_ids:
            self.shared.add(req.all_ids)

    @staticmethod
    def _no_drafts(batch: Sequence[Request]) -> list[tuple[int, ...]]:
        for req in batch:
            if req.spec is not None:
                req.spec.record(0, 0)  # (its rate drifts back toward the prior: see RATE_RECOVERY)
        return [()] * len(batch)

    def verified(self, req: Request, proposed: int, accepted: int) -> None:
        assert req.spec is not None
        req.spec.record(proposed, accepted)
        if proposed:
            c = req.spec.cls
            self.recent_rates[c] += RECENT_RATE_EMA * (accepted / tested_drafts(proposed, accepted)
                                                       - self.recent_rates[c])
        self.stats.proposed += proposed
        self.stats.accepted += accepted
        self.stats.verify_steps += 1


def _grammar_cut(req: Request, draft: Sequence[int]) -> tuple[int, ...]:
    """The draft up to the first token the request's grammar would reject (all of it without a grammar)."""
    if draft and req.matcher is not None:
        draft = draft[: req.matcher.validate_tokens(list(draft))]
    return tuple(draft)


def ema(old: float | None, new: float, weight: float = STEP_TIME_EMA) -> float:
    """An exponential moving average's next value (the first sample starts it)."""
    return new if old is None else (1 - weight) * old + weight * new
