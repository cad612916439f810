"""Stop-string matching on a stream of text deltas.

Invariant: everything emitted so far contains no stop string and no text that could begin one, i.e. the held
back buffer is the longest suffix of the stream that is a proper prefix of some stop string. Hence a match can
only start inside the buffer, and searching `held + delta` (short) finds every match across token boundaries.
"""
from __future__ import annotations


class StopChecker:
    def __init__(self, stop: tuple[str, ...]) -> None:
        # "" would match before the first character of every stream; treat it as no stop string at all.
        self._stops = tuple(s for s in stop if s)
        self._held = ""
        self.matched: str | None = None

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def feed(self, text_delta: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string matched by this delta or None).

        After a match the stream is over: the text from the stop string on is dropped, so any later feed
        returns ("", None) (the match was reported once, and `matched` keeps it).
        """
        if self.matched is not None:
            return "", None
        text = self._held + text_delta
        # The match that completes first as the text streams in: the earliest end; at the same end, the longest
        # (earliest start), so no part of any stop string is ever emitted. This makes the result independent of
        # how the text was split into deltas.
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        if best is not None:
            self.matched = best[2]
            self._held = ""
            return text[: best[1]], self.matched
        hold = self._held_suffix_len(text)
        self._held = text[len(text) - hold:]
        return text[: len(text) - hold], None

    def flush(self) -> str:
        """At the end of the stream (no stop matched): release the held-back text."""
        held, self._held = self._held, ""
        return held
