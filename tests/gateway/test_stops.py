"""Stop strings are found across any split of the text and never emitted."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlxd.gateway.generation import StopMatcher


def reference(text: str, stops: list[str], include: bool) -> tuple[str, bool]:
    """Text arriving one character at a time: the first stop string to complete ends it."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if s and text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return (text[:end] if include else text[: end - len(s)]), True
    return text, False


def run(pieces: list[str], stops: list[str], include: bool = False) -> tuple[str, bool]:
    m = StopMatcher(stops, include)
    out = []
    for piece in pieces:
        out.append(m.feed(piece))
        if m.stopped:
            break
    if not m.stopped:
        out.append(m.flush())
    return "".join(out), m.stopped


def test_stop_split_over_three_pieces():
    assert run(["Hello wo", "r", "ld! more"], ["world"]) == ("Hello ", True)
    assert run(["Hello wo", "r", "ld! more"], ["world"], include=True) == ("Hello world", True)


def test_false_start_is_released():
    m = StopMatcher(["abc"])
    assert m.feed("xxab") == "xx"  # "ab" might start "abc"
    assert m.feed("d") == "abd"
    assert m.flush() == ""


def test_held_text_is_flushed_at_the_end():
    assert run(["the end a", "b"], ["abc"]) == ("the end ab", False)


def test_first_completed_stop_wins_and_longest_at_equal_end():
    assert run(["one two three"], ["three", "two"]) == ("one ", True)
    # "ab" completes before "abcd" could: generation would have ended there.
    assert run(["xx abcd"], ["ab", "abcd"], include=True) == ("xx ab", True)
    assert run(["xx abcd"], ["bcd", "abcd"]) == ("xx ", True)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text("abc ", max_size=30),
    stops=st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    include=st.booleans(),
)
def test_any_split_matches_the_whole_text_reference(text, stops, cuts, include):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert run(pieces, stops, include) == reference(text, stops, include)


def test_the_matched_stop_string_is_reported():
    m = StopMatcher(["END", "ENDING", "x"])
    assert m.feed("abc EN") == "abc " and m.matched is None
    assert m.feed("DING") == "" and m.stopped and m.matched == "END"
    m = StopMatcher(["zz"])
    m.feed("no stop here")
    assert m.flush() == "" and m.matched is None and not m.stopped
