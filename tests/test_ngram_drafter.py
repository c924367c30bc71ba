"""Tests of the n-gram index and drafter against a brute-force linear-scan reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lattice_inference.drafters.base import Drafter
from lattice_inference.drafters.ngram import NgramDrafter, NgramIndex
from lattice_inference.errors import ConfigError, TokenError


def brute_force_propose(
    history: list[int],
    *,
    max_ngram: int,
    min_ngram: int,
    max_draft: int,
    match: str,
    eos: set[int],
    max_tokens: int,
) -> list[int]:
    """Linear-scan specification of NgramDrafter.propose."""
    k = min(max_draft, max_tokens)
    if k <= 0:
        return []
    size = len(history)
    for n in range(min(max_ngram, size), min_ngram - 1, -1):
        suffix = history[size - n :]
        # Occurrences whose last token lies before the last history position.
        ends = [e for e in range(n - 1, size - 1) if history[e - n + 1 : e + 1] == suffix]
        if ends:
            end = ends[0] if match == "first" else ends[-1]
            draft = history[end + 1 : end + 1 + k]
            for i, tok in enumerate(draft):
                if tok in eos:
                    return draft[:i]
            return draft
    return []


def brute_force_lookup(tokens: list[int], pattern: list[int], keep: str) -> int | None:
    n = len(pattern)
    ends = [e for e in range(n - 1, len(tokens)) if tokens[e - n + 1 : e + 1] == pattern]
    if not ends:
        return None
    return ends[0] if keep == "first" else ends[-1]


token_lists = st.integers(min_value=1, max_value=4).flatmap(
    lambda alphabet: st.lists(st.integers(0, alphabet - 1), max_size=30)
)


@st.composite
def drafter_scenarios(draw):
    alphabet = draw(st.integers(min_value=1, max_value=4))
    tok = st.integers(0, alphabet - 1)
    max_ngram = draw(st.integers(1, 6))
    min_ngram = draw(st.integers(1, max_ngram))
    max_draft = draw(st.integers(1, 6))
    match = draw(st.sampled_from(["first", "recent"]))
    eos = draw(st.sets(st.integers(0, alphabet), max_size=2))
    prompt = draw(st.lists(tok, max_size=25))
    ops = draw(
        st.lists(
            st.one_of(
                st.tuples(st.just("extend"), st.lists(tok, max_size=4)),
                st.tuples(st.just("propose"), st.integers(-1, 8)),
            ),
            max_size=25,
        )
    )
    return dict(max_ngram=max_ngram, min_ngram=min_ngram, max_draft=max_draft, match=match), eos, prompt, ops


@settings(max_examples=300, deadline=None)
@given(drafter_scenarios())
def test_drafter_matches_brute_force(scenario):
    options, eos, prompt, ops = scenario
    drafter = NgramDrafter(**options, eos_token_ids=eos)
    state = drafter.start(prompt)
    history = list(prompt)
    for op, arg in [*ops, ("propose", 8)]:
        if op == "extend":
            state.extend(arg)
            history.extend(arg)
        else:
            expected = brute_force_propose(history, eos=eos, max_tokens=arg, **options)
            assert state.propose(arg) == expected
        assert list(state.history) == history
        assert len(state.history) == len(history)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 3).flatmap(lambda lo: st.tuples(st.just(lo), st.integers(lo, 5))),
    st.sampled_from(["first", "recent"]),
    token_lists,
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), max_size=10),
)
def test_index_lookup_matches_brute_force(ngram_range, keep, tokens, patterns):
    lo, hi = ngram_range
    index = NgramIndex(lo, hi, keep=keep)
    # Extend in two chunks to exercise incremental indexing.
    index.extend(tokens[: len(tokens) // 2])
    index.extend(tokens[len(tokens) // 2 :])
    assert list(index.tokens) == tokens
    for pattern in patterns + [tokens[i : i + lo] for i in range(len(tokens) - lo + 1)]:
        if lo <= len(pattern) <= hi:
            assert index.lookup(pattern) == brute_force_lookup(tokens, pattern, keep)
        else:
            with pytest.raises(ConfigError, match="outside the indexed range"):
                index.lookup(pattern)


def test_is_a_drafter():
    assert isinstance(NgramDrafter(), Drafter)


def test_first_and_recent_policies():
    history = [7, 1, 2, 3, 9, 1, 2, 4, 8, 1, 2]
    first = NgramDrafter(max_ngram=3, min_ngram=2, max_draft=2, match="first")
    recent = NgramDrafter(max_ngram=3, min_ngram=2, max_draft=2, match="recent")
    first_state = first.start(history)
    recent_state = recent.start(history)
    assert first_state.propose(10) == [3, 9]
    assert recent_state.propose(10) == [4, 8]
    # max_tokens caps the draft below max_draft; non-positive asks for nothing.
    assert first_state.propose(1) == [3]
    assert first_state.propose(0) == []
    assert first_state.propose(-3) == []


def test_longest_ngram_wins_and_self_match_ignored():
    drafter = NgramDrafter(max_ngram=4, min_ngram=1, max_draft=3)
    state = drafter.start([5, 6, 5, 6, 7, 1, 2, 6, 7])
    # Suffix [6, 7] occurs at end 4 (before the last position): continuation [1, 2, 6].
    assert state.propose(4) == [1, 2, 6]
    state = drafter.start([1, 2, 3])  # Only the trailing self-match: no draft.
    assert state.propose(4) == []


def test_draft_truncated_before_eos():
    drafter = NgramDrafter(max_ngram=2, min_ngram=2, max_draft=4, eos_token_ids=[99])
    assert drafter.start([1, 2, 3, 99, 5, 1, 2]).propose(4) == [3]
    assert drafter.start([1, 2, 99, 5, 1, 2]).propose(4) == []


def test_accepts_numpy_and_extends_incrementally():
    drafter = NgramDrafter(max_ngram=3, min_ngram=2, max_draft=4)
    state = drafter.start(np.array([4, 5, 6, 7, 8], dtype=np.int64))
    assert state.propose(4) == []
    state.extend([4])
    assert state.propose(4) == []  # min_ngram 2: [8, 4] not seen before
    state.extend(np.array([5]))
    assert state.propose(4) == [6, 7, 8, 4]
    assert all(type(t) is int for t in state.history)


def test_propose_on_an_empty_history_is_empty():
    assert NgramDrafter().start([]).propose(4) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_ngram": 0}, r"max_ngram must be >= 1, got 0"),
        ({"min_ngram": 0}, r"min_ngram must be >= 1, got 0"),
        ({"max_ngram": 2, "min_ngram": 3}, r"min_ngram \(3\) must be <= max_ngram \(2\)"),
        ({"max_draft": 0}, r"max_draft must be >= 1, got 0"),
        ({"match": "last"}, r"match must be one of 'first', 'recent'; got 'last'"),
        ({"max_ngram": 2.5}, r"max_ngram must be an int"),
        ({"max_draft": True}, r"max_draft must be an int"),
    ],
)
def test_option_validation(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        NgramDrafter(**kwargs)


def test_index_option_validation():
    with pytest.raises(ConfigError, match=r"min_ngram \(4\) must be <= max_ngram \(3\)"):
        NgramIndex(4, 3)
    with pytest.raises(ConfigError, match="match must be one of"):
        NgramIndex(1, 3, keep="last")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, -2], r"element 1 is -2; token ids must be non-negative"),
        ([1.0], r"element 0 is 1.0 of type float"),
        ([True], r"element 0 is a bool"),
        (["a"], r"element 0 is 'a' of type str"),
    ],
)
def test_token_validation(tokens, message):
    drafter = NgramDrafter()
    with pytest.raises(TokenError, match=message):
        drafter.start(tokens)
    state = drafter.start([1, 2])
    with pytest.raises(TokenError, match=message):
        state.extend(tokens)
    assert list(state.history) == [1, 2]  # a failed extend appends nothing
    with pytest.raises(TokenError, match=message):
        NgramIndex().extend(tokens)
    with pytest.raises(TokenError, match="eos_token_ids"):
        NgramDrafter(eos_token_ids=[-1])


def test_under_a_grammar_a_one_token_context_drafts_and_fallback_and_suffix_states_pass_it_on():
    """`DrafterState.under_grammar`: prompt lookup tries n-grams down to `GRAMMAR_MIN_NGRAM` (1) in that generation
    only; the default state (``min_ngram=2``) finds nothing after ``7 5``, the constrained one continues the
    earlier ``5`` with ``6 7 5``. A fallback (``ngram+mtp``-like) and a suffix state pass it to their lookups."""
    from lattice_inference.drafters.fallback import FallbackDrafter
    from lattice_inference.drafters.suffix import SuffixDrafter

    history = [5, 6, 7, 5]
    drafter = NgramDrafter(max_ngram=3, min_ngram=2, max_draft=4)
    plain, constrained = drafter.start(history), drafter.start(history)
    constrained.under_grammar()
    assert plain.propose(4) == [] and constrained.propose(4) == [6, 7, 5]
    assert constrained.propose(4).key == 1 and drafter.min_ngram == 2 and plain.propose(4) == []
    fallback = FallbackDrafter([NgramDrafter(max_ngram=3, min_ngram=2, max_draft=4)]).start(history)
    fallback.under_grammar()
    assert fallback.propose(4) == [6, 7, 5]
    suffix = SuffixDrafter(1024, 4, max_ngram=3, min_ngram=2)
    states = [suffix.start(history), suffix.start(history)]
    states[1].under_grammar()
    assert [s.propose(4) for s in states] == [[], [6, 7, 5]]
