"""`SuffixIndex`: the deepest match wins, frequency ranks continuations, eviction keeps the budget, work is flat."""

from __future__ import annotations

import random

import pytest

from lattice_inference.drafters import suffix_index as si
from lattice_inference.drafters.suffix_index import KEEP, SuffixIndex
from lattice_inference.errors import ConfigError


def test_deepest_match_decides_and_frequency_ranks_its_continuations():
    index = SuffixIndex(1000)
    index.begin([9, 1, 2, 3, 4, 50, 51])
    index.begin([8, 1, 2, 3, 4, 60, 61])  # 3 occurrences of 1 2 3 4 with 60, one with 50
    index.begin([7, 1, 2, 3, 4, 60, 62])
    index.begin([6, 1, 2, 3, 4, 60, 61, 63])
    match = index.match([0, 2, 3, 4], 5)
    assert match.draft == [60, 61, 63] and match.support == 3 and match.depth == 3
    assert match.runners_up == [[50], [62], []]
    deeper = index.match([9, 1, 2, 3, 4], 5)  # only the first sequence holds this longer context
    assert deeper.draft == [50, 51] and deeper.depth == 5 and deeper.support == 1


def test_ties_go_to_the_most_recent_and_stop_tokens_cut_the_draft():
    index = SuffixIndex(1000)
    index.begin([1, 2, 30, 31])
    index.begin([1, 2, 40, 2, 41])
    assert index.match([5, 1, 2], 4).draft == [40, 2, 41]
    assert index.match([5, 1, 2], 4, stop=frozenset({2})).draft == [40]
    assert index.match([5, 1, 2], 4, stop=frozenset({40})).draft == []
    assert index.match([5, 1, 2], 1).draft == [40]
    assert index.match([5, 1, 2], 0).draft == []


def test_the_running_sequence_matches_itself_but_never_its_own_last_token():
    index = SuffixIndex(1000)
    seq = index.begin([5, 6, 7])
    assert index.match([5, 6, 7], 3).draft == []  # the only occurrence is the trailing one
    index.append(seq, [1, 5, 6])
    assert index.match([1, 5, 6], 3).draft == [7, 1, 5]
    assert index.match([3, 4], 3).draft == []  # nothing matches the shortest anchor


def test_budget_evicts_oldest_tokens_and_their_anchors():
    index = SuffixIndex(10)
    index.begin([1, 2, 3, 4, 5, 6])
    assert index.match([1, 2], 2).draft == [3, 4]
    index.begin([7, 8, 9, 10, 11, 12])  # 12 tokens: the oldest two (1, 2) go
    assert len(index) == 10
    assert index.match([1, 2], 2).draft == []
    assert index.match([3, 4], 2).draft == [5, 6]
    seq = index.begin(range(20, 40))  # longer than the budget: whole sequences go, then its own oldest tokens
    assert len(index) == 10 and index.sequences == 1
    assert index.match([3, 4], 2).draft == [] and index.match([30, 31], 2).draft == [32, 33]
    assert index.match([20, 21], 2).draft == []
    index.append(seq, [30, 31])
    assert len(index) == 10
    # Nothing but the held tokens' anchors stays indexed.
    assert index.anchors <= 10 * len(si.ANCHORS)


def test_random_workload_stays_within_budget_and_consistent():
    rng = random.Random(3)
    index = SuffixIndex(500)
    for _ in range(60):
        seq = index.begin([rng.randrange(30) for _ in range(rng.randint(0, 40))])
        for _ in range(rng.randint(0, 5)):
            index.append(seq, [rng.randrange(30) for _ in range(rng.randint(1, 8))])
        assert len(index) <= 500
        held = sum(len(s.tokens) - s.start for s in index._sequences.values())
        assert held == len(index)
        positions = sum(1 if isinstance(v, int) else len(v) for m in index._maps for v in m.values())
        assert positions <= len(index) * len(si.ANCHORS)
        context = [rng.randrange(30) for _ in range(6)]
        for tok in index.match(context, 5).draft:
            assert 0 <= tok < 30
    index.clear()
    assert len(index) == 0 and index.anchors == 0 and index.match([1, 2], 3).draft == []


def test_hash_collisions_are_checked_token_by_token(monkeypatch):
    monkeypatch.setattr(si, "hash", lambda _: 0, raising=False)  # every anchor collides
    index2 = SuffixIndex(100)
    index2.begin([1, 2, 3, 4])
    assert index2.match([7, 8], 2).draft == []
    assert index2.match([1, 2], 2).draft == [3, 4]


def test_lookup_work_is_bounded_whatever_the_index_holds():
    """A context whose anchors occur everywhere examines at most KEEP occurrences per anchor length, at 1k tokens
    as at 200k (the timing is `bench/bench_suffix.py`'s)."""
    examined = []
    for size in (1_000, 200_000):
        index = SuffixIndex(size)
        index.begin([1, 2, 3] * (size // 3))
        match = index.match([1, 2, 3, 1, 2, 3, 1, 2], 10)
        assert match.draft == [3, 1, 2, 3, 1, 2, 3, 1, 2, 3] and match.depth == 8
        examined.append(index.examined)
    assert examined[0] == examined[1] <= KEEP * len(si.ANCHORS)


def test_budget_must_be_positive():
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ConfigError, match="suffix_budget"):
            SuffixIndex(bad)  # type: ignore[arg-type]
