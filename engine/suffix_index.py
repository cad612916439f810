"""N-gram drafts from other requests' text: answers often repeat what earlier answers said (a shared system
prompt's boilerplate, the same question asked twice, a template filled in again), which a request's own prompt and
output do not hold.

`SharedIndex` keeps the whole token sequences (prompt and output) of recently finished requests, up to a token
budget, and the latest place each 3- and 4-gram of them occurred. A request whose own text proposes nothing looks
up its last tokens here and proposes what followed them there. 2-grams are left out: across many requests they
match nearly everywhere and propose noise. The sequences are only read to propose drafts, which verification
checks like any other (engine/speculative.py), so another request's text can change how fast a request runs, never
what it outputs.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

SHARED_NGRAMS = (4, 3)  # longest first
SHARED_MAX_TOKENS = 100_000  # ~45 MiB of index (measured with tracemalloc): a few hundred answers' worth
# Of each sequence only its last this many tokens (its answer and the prompt's end): indexing costs ~1 us a token on
# the engine thread at the request's finish, so a long prompt's whole text would stall a step.
SHARED_MAX_SEQUENCE = 8192


MATCH_CAP = 8  # how far back a proposal's source is compared with the suffix (engine/speculative.py MATCH_CLASSES)


def common_suffix(src: Sequence[int], end: int, ids: Sequence[int]) -> int:
    """How many tokens before src[end] equal the last ones of ids, up to MATCH_CAP."""
    n, cap = 0, min(MATCH_CAP, end, len(ids))
    while n < cap and src[end - 1 - n] == ids[-1 - n]:
        n += 1
    return n


class SharedIndex:
    """The n-grams of recently finished requests' token sequences (engine thread only)."""

    def __init__(self, max_tokens: int = SHARED_MAX_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.seqs: OrderedDict[int, list[int]] = OrderedDict()  # id -> tokens, oldest first
        self.tokens = 0
        self._next_id = 0
        self.matched = 0  # tokens of the last proposal's source that equal the suffix (up to MATCH_CAP)
        # n-gram -> (sequence id, position after the n-gram), the latest occurrence
        self.maps: dict[int, dict[tuple[int, ...], tuple[int, int]]] = {n: {} for n in SHARED_NGRAMS}

    def add(self, ids: Sequence[int]) -> None:
        """Index a finished request's tokens; the oldest sequences go once the budget is spent."""
        seq = list(ids[-min(SHARED_MAX_SEQUENCE, self.max_tokens):])
        if len(seq) < min(SHARED_NGRAMS) + 1:
            return
        sid = self._next_id
        self._next_id += 1
        self.seqs[sid] = seq
        self.tokens += len(seq)
        for n, m in self.maps.items():
            for end in range(n, len(seq)):  # an n-gram ending at `end` with a follower seq[end]
                m[tuple(seq[end - n : end])] = (sid, end)
        while self.tokens > self.max_tokens:
            self._drop_oldest()

    def propose(self, ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix n-gram of `ids` in an indexed sequence."""
        self.matched = 0
        if k <= 0:
            return []
        for n, m in self.maps.items():
            if len(ids) < n:
                continue
            hit = m.get(tuple(ids[len(ids) - n :]))
            if hit is not None:
                sid, end = hit
                seq = self.seqs[sid]
                self.matched = common_suffix(seq, end, ids)
                return seq[end : end + k]
        return []

    def _drop_oldest(self) -> None:
        sid, seq = self.seqs.popitem(last=False)
        self.tokens -= len(seq)
        for n, m in self.maps.items():
            for end in range(n, len(seq)):
                key = tuple(seq[end - n : end])
                if m.get(key, (None,))[0] == sid:  # (a later sequence's occurrence stays)
                    del m[key]
