"""Unit tests of the decode loop against a pure-Python context-keyed target (fast, many cases)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lattice_inference.decode import SpeculativeDecoder
from lattice_inference.errors import ConfigError, TokenError
from lattice_inference.verify import verify_prefix

from .helpers import ContextKeyedTarget, OracleDrafter, RecordingTarget


def committed_feeds(rec: RecordingTarget) -> list[tuple[int, int]]:
    """(position, token) of every fed token that survived its round's rollback."""
    feeds = []
    prefill = rec.forwards[0][1]
    feeds += list(enumerate(prefill))
    for (start, tokens), kept in zip(rec.forwards[1:], rec.rollbacks, strict=True):
        feeds += [(start + i, t) for i, t in enumerate(tokens[: kept - start])]
    return feeds


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 11), min_size=1, max_size=30),
    max_new=st.integers(0, 40),
    seed=st.integers(0, 5),
    corrupt=st.sampled_from([0.0, 0.2, 0.6, 1.0]),
    max_draft=st.integers(1, 6),
    eos=st.one_of(st.none(), st.integers(0, 11)),
)
def test_output_equals_greedy_and_every_token_fed_once(prompt, max_new, seed, corrupt, max_draft, eos):
    model = ContextKeyedTarget(vocab=12, seed=seed)
    expected = model.greedy(prompt, max_new, eos=eos)
    reference = prompt + model.greedy(prompt, max_new + 10)
    rec = RecordingTarget(ContextKeyedTarget(vocab=12, seed=seed))
    drafter = OracleDrafter(reference, vocab=12, corrupt=corrupt, seed=seed)
    dec = SpeculativeDecoder(
        rec, drafter, max_draft=max_draft, eos_token_ids=[] if eos is None else [eos], adaptive=False
    )
    gen = dec.start(prompt, max_new)
    result = gen.result()
    assert result.token_ids == expected
    assert len(result.token_ids) <= max_new
    assert result.stop_reason == ("eos" if len(expected) < max_new else "length")
    if max_new == 0:
        assert rec.forwards == []
        return
    # Every committed token sits at the position equal to its index, each exactly once, contiguously.
    seq = prompt + result.token_ids + ([eos] if result.stop_reason == "eos" else [])
    feeds = committed_feeds(rec)
    assert [p for p, _ in feeds] == list(range(len(feeds)))
    n = min(len(feeds), len(seq))
    assert [t for _, t in feeds][:n] == seq[:n]
    # The cache after each round holds the sequence minus the pending token (tokens accepted after an EOS
    # may remain when generation stops there; they are never emitted).
    assert gen.sequence is not None and gen.sequence.length == len(feeds)
    if result.stop_reason == "length":
        assert len(feeds) == len(seq) - 1
    m = result.metrics
    assert m.target_forwards == len(rec.forwards) - 1
    assert m.accepted_tokens <= m.drafted_tokens


def test_bonus_token_emitted_on_full_acceptance():
    model = ContextKeyedTarget(vocab=12, seed=1)
    prompt = [1, 2, 3]
    reference = prompt + model.greedy(prompt, 50)
    rec = RecordingTarget(ContextKeyedTarget(vocab=12, seed=1))
    drafter = OracleDrafter(reference, vocab=12, corrupt=0.0)
    drafter.rng.randint = lambda a, b: b  # always draft the full allowance
    dec = SpeculativeDecoder(rec, drafter, max_draft=4, adaptive=False)
    result = dec.generate(prompt, 21)
    assert result.token_ids == reference[3:24]
    # 1 token from prefill, then 4 rounds of 4 drafts + 1 bonus = 21 tokens in 4 forwards.
    assert result.metrics.target_forwards == 4
    assert [len(t) for _, t in rec.forwards[1:]] == [5, 5, 5, 5]
    assert result.metrics.mean_acceptance_length == 5.0
    assert result.metrics.accepted_per_position == [4, 4, 4, 4]


def test_budget_ends_inside_a_draft():
    model = ContextKeyedTarget(vocab=12, seed=2)
    prompt = [5, 6]
    reference = prompt + model.greedy(prompt, 50)
    for budget in range(1, 9):
        drafter = OracleDrafter(reference, vocab=12, corrupt=0.0)
        drafter.rng.randint = lambda a, b: b
        rec = RecordingTarget(ContextKeyedTarget(vocab=12, seed=2))
        result = SpeculativeDecoder(rec, drafter, max_draft=4, adaptive=False).generate(prompt, budget)
        assert result.token_ids == reference[2 : 2 + budget]
        # Never drafts past what the budget can emit.
        assert all(len(t) <= budget for _, t in rec.forwards[1:])


def test_eos_inside_a_draft_stops_exactly_there():
    prompt = [1, 2, 3]
    model = ContextKeyedTarget(vocab=12, seed=3, forced={(1, 2, 3): 4, (3, 4): 5, (4, 5): 9})
    greedy = model.greedy(prompt, 20)
    assert greedy[:3] == [4, 5, 9]
    drafter = OracleDrafter(prompt + greedy, vocab=12, corrupt=0.0)
    drafter.rng.randint = lambda a, b: b
    result = SpeculativeDecoder(
        ContextKeyedTarget(vocab=12, seed=3, forced=model.forced),
        drafter,
        max_draft=4,
        eos_token_ids=[9],
        adaptive=False,
    ).generate(prompt, 20)
    assert result.token_ids == [4, 5]
    assert result.stop_reason == "eos"


def test_draft_rejected_at_once_still_emits_target_token():
    model = ContextKeyedTarget(vocab=12, seed=4)
    prompt = [7, 7, 7]
    reference = prompt + model.greedy(prompt, 30)
    drafter = OracleDrafter(reference, vocab=12, corrupt=1.0)
    result = SpeculativeDecoder(ContextKeyedTarget(vocab=12, seed=4), drafter, max_draft=3, adaptive=False).generate(
        prompt, 30
    )
    assert result.token_ids == reference[3:]
    assert result.metrics.accepted_tokens == 0
    assert result.metrics.drafts > 0


def test_verify_prefix_rules():
    assert verify_prefix([], [7]).tokens == [7]
    assert verify_prefix([1, 2, 3], [1, 2, 3, 4]).tokens == [1, 2, 3, 4]
    v = verify_prefix([1, 2, 3], [1, 5, 3, 4])
    assert (v.accepted, v.tokens) == (1, [1, 5])
    assert verify_prefix([1], [2, 0]).tokens == [2]
    with pytest.raises(ValueError, match="need 3 target choices"):
        verify_prefix([1, 2], [1])


def test_bad_input_is_rejected_before_any_forward():
    rec = RecordingTarget(ContextKeyedTarget(vocab=12))
    dec = SpeculativeDecoder(rec, adaptive=False, max_draft=4)
    with pytest.raises(TokenError, match="empty"):
        dec.generate([], 5)
    with pytest.raises(TokenError, match="id 12, outside the vocabulary of size 12"):
        dec.generate([1, 12], 5)
    with pytest.raises(TokenError, match="id -1"):
        dec.generate([-1], 5)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        dec.generate([1], -1)
    with pytest.raises(ConfigError, match="max_draft"):
        SpeculativeDecoder(rec, max_draft=0, adaptive=False)
    assert rec.forwards == []
