"""Stop strings over streamed text: whatever the split, the output is the text cut before the first stop."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from lattice_inference.serve.stops import StopMatcher


def run(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out = ""
    for piece in pieces:
        out += matcher.push(piece)
        if matcher.stopped:
            break
    return out + matcher.flush(), matcher.stopped


def cut(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def test_stop_across_pieces_is_held_back_then_cut():
    matcher = StopMatcher(["END"])
    assert matcher.push("abc E") == "abc "
    assert matcher.push("N") == ""
    assert matcher.push("Dxyz") == "" and matcher.stopped
    assert matcher.flush() == ""


def test_a_false_start_is_released():
    matcher = StopMatcher(["END"])
    assert matcher.push("EN") == ""
    assert matcher.push("d") == "ENd"
    assert matcher.push("E") == ""
    assert matcher.flush() == "E" and not matcher.stopped


def test_earliest_of_several_stops_wins_and_no_stops_passes_through():
    assert run(["one two", " three"], ["three", "two"]) == ("one ", True)
    assert run(["a", "b"], []) == ("ab", False)


@given(
    text=st.text(alphabet="abc\n", max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=3),
)
def test_any_split_equals_cutting_the_whole_text(text, cuts, stops):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert run(pieces, stops) == cut(text, stops)
