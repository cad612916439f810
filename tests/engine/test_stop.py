"""Stop strings across deltas: nothing from the stop string on is emitted; partial matches are held back."""
from __future__ import annotations

import pytest

from engine.stop import StopChecker


def run(stops: tuple[str, ...], deltas: list[str]) -> tuple[list[str], str | None, str]:
    """Feed deltas until a match; return (emitted pieces, match, flushed tail)."""
    checker = StopChecker(stops)
    emitted: list[str] = []
    for delta in deltas:
        text, hit = checker.feed(delta)
        emitted.append(text)
        if hit is not None:
            return emitted, hit, checker.flush()
    return emitted, None, checker.flush()


@pytest.mark.parametrize(
    "deltas",
    [
        ["Hello wor", "ld. ###", " more"],  # whole stop inside one delta
        ["Hello world. #", "##", " more"],  # split across 2
        ["Hello world. #", "#", "# more"],  # split across 3
        ["Hello world. ", "#", "#", "#"],
        list("Hello world. ### more"),  # one character at a time
    ],
)
def test_stop_split_across_deltas(deltas: list[str]) -> None:
    emitted, hit, tail = run(("###",), deltas)
    assert hit == "###"
    assert "".join(emitted) == "Hello world. "
    assert tail == ""


def test_partial_match_is_held_back_then_released() -> None:
    checker = StopChecker(("###",))
    assert checker.feed("a #") == ("a ", None)  # "#" might start "###"
    assert checker.feed("#") == ("", None)
    assert checker.feed("x") == ("##x", None)  # it did not
    assert checker.feed("b#") == ("b", None)
    assert checker.flush() == "#"


def test_stop_at_the_very_start() -> None:
    emitted, hit, _ = run(("<stop>",), ["<st", "op>", "tail"])
    assert hit == "<stop>" and "".join(emitted) == ""
    emitted, hit, _ = run(("\n",), ["\nrest"])
    assert hit == "\n" and emitted == [""]


def test_no_stop_flush_returns_everything() -> None:
    deltas = ["The end", " is nea", "r END", "IN"]  # ends on a prefix of the stop string
    emitted, hit, tail = run(("ENDING",), deltas)
    assert hit is None
    assert "".join(emitted) + tail == "".join(deltas)
    assert tail == "ENDIN"


def test_overlapping_candidates() -> None:
    # "abc" and "bcd": "abc" completes first as the text streams in.
    assert run(("bcd", "abc"), ["xab", "cd"])[:2] == (["x", ""], "abc")
    # A longer stop that would start earlier but ends later loses to the one completing first,
    # whatever the delta split (this is what a character-by-character stream gives).
    for deltas in (["xabcd"], ["xab", "cd"], list("xabcd")):
        emitted, hit, _ = run(("xabcd", "bc"), deltas)
        assert (hit, "".join(emitted)) == ("bc", "xa")
    # Two stops ending together: the longer one is reported, so none of it is emitted.
    emitted, hit, _ = run(("c", "abc"), ["zab", "c"])
    assert (hit, "".join(emitted)) == ("abc", "z")
    # A stop that is a prefix of another.
    emitted, hit, _ = run(("END", "ENDING"), ["THE E", "NDING"])
    assert (hit, "".join(emitted)) == ("END", "THE ")


def test_repeated_prefix_characters() -> None:
    # The held suffix must be the LONGEST one that could start a stop: "aab" in "aaaab".
    emitted, hit, _ = run(("aab",), ["a", "a", "a", "a", "b", "z"])
    assert (hit, "".join(emitted)) == ("aab", "aa")


def test_after_a_match_nothing_more_is_emitted() -> None:
    checker = StopChecker(("x",))
    assert checker.feed("axb") == ("a", "x")
    assert checker.feed("more") == ("", None)
    assert checker.flush() == ""
    assert checker.matched == "x"


def test_no_stop_strings_passes_everything_through() -> None:
    checker = StopChecker(("",))  # an empty stop string is ignored, not matched everywhere
    assert checker.feed("abc") == ("abc", None)
    assert checker.flush() == ""
