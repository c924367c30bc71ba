"""The adaptive draft planner, the forward-cost table it plans with, and the decode loop driven by it."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lattice_inference.acceptance import CARRY
from lattice_inference.decode import SpeculativeDecoder
from lattice_inference.draft_planner import PROBE_EVERY, DraftPlanner
from lattice_inference.targets.facts import ForwardCosts
from lattice_inference.targets.forward_cost import (
    CALIBRATION_CONTEXT,
    calibration_widths,
    forward_costs,
    measure_forward_costs,
)

from .helpers import ContextKeyedTarget, OracleDrafter, RecordingTarget

FLAT = ForwardCosts((1, 2, 9), (1.0, 1.0, 1.0))
"""Verification as cheap as a decode step (a GPU, or a model whose step is all overhead)."""
STEEP = ForwardCosts((1, 2, 9), (1.0, 2.0, 3.0))
"""A 2-token forward costs two steps (this CPU's F.linear without packed weights)."""
MILD = ForwardCosts((1, 2, 9), (1.0, 1.1, 1.8))
"""Verification that grows with its width, as on a CPU whose products are compute-bound at 16 rows."""


def test_forward_costs_interpolate_between_and_beyond_measured_widths() -> None:
    costs = ForwardCosts((1, 2, 4), (1.0, 1.5, 2.5))
    assert costs.seconds(1) == 1.0
    assert costs.seconds(3) == pytest.approx(2.0)
    assert costs.seconds(6) == pytest.approx(3.5)  # extrapolated along the last segment
    assert costs.relative(4) == 2.5
    assert costs.to_dict() == {"1": 1.0, "2": 1.5, "4": 2.5}
    assert calibration_widths(9) == [1, 2, 4, 8, 9]
    assert calibration_widths(1) == [1]


def test_measure_forward_costs_times_each_width_and_leaves_a_prefilled_scratch_context() -> None:
    rec = RecordingTarget(ContextKeyedTarget(vocab=12))
    costs = measure_forward_costs(rec, [4, 2], repeats=2)
    assert costs.widths == (1, 2, 4)
    assert all(t > 0 for t in costs.measured)
    assert sorted({len(tokens) for _, tokens in rec.forwards[1:]}) == [1, 2, 4]
    assert rec.rollbacks and set(rec.rollbacks) == {CALIBRATION_CONTEXT}
    assert forward_costs(rec, 4) is forward_costs(rec, 3)  # measured once per target


def test_planner_drafts_everything_when_verification_is_free_and_drafts_are_accepted() -> None:
    planner = DraftPlanner(FLAT)
    for _ in range(20):
        planner.record([1] * 8, 8, 8, next_token=0)
    assert planner.choose(8) == 8
    assert planner.acceptance(0) > 0.9


def test_planner_stops_drafting_when_drafts_fail_and_verification_is_dear() -> None:
    planner = DraftPlanner(STEEP)
    assert planner.choose(8) == 0  # the prior (0.6 per position) does not pay for a 2x verification
    cheap = DraftPlanner(ForwardCosts((1, 9), (1.0, 1.4)))
    assert cheap.choose(8) > 0
    for _ in range(30):
        cheap.record([1] * 8, cheap.choose(8), 0, next_token=5)
    assert cheap.choose(8) == 0


def test_planner_learns_from_unverified_lookup_tokens() -> None:
    """With nothing verified, the target's next token still says whether the first draft token was right."""
    planner = DraftPlanner(STEEP)
    before = planner.acceptance(0)
    for _ in range(30):
        planner.record([7, 8], 0, 0, next_token=7)
    assert planner.acceptance(0) > 0.95 > before
    planner.record([7, 8], 0, 0, next_token=3)
    assert planner.acceptance(0) < 0.95


def test_planner_keeps_statistics_per_key() -> None:
    planner = DraftPlanner(FLAT)
    for _ in range(20):
        planner.record([1, 1, 1], 3, 3, next_token=0, key=5)
        planner.record([1, 1, 1], 3, 0, next_token=0, key=2)
    assert planner.acceptance(0, key=5) > planner.acceptance(0) > planner.acceptance(0, key=2)


def test_planner_probes_a_costly_drafter_after_plain_rounds() -> None:
    planner = DraftPlanner(STEEP)
    picks = [planner.choose(3, free=False) for _ in range(PROBE_EVERY)]
    assert picks[:-1] == [0] * (PROBE_EVERY - 1) and picks[-1] == 1
    assert [planner.choose(3) for _ in range(PROBE_EVERY)] == [0] * PROBE_EVERY  # free: never forced


def test_a_first_draft_in_hand_is_a_sunk_cost_and_needs_no_probe() -> None:
    """An MTP head's first draft, drafted to read its confidence, is paid for whatever the planner picks: only the
    drafts still to come are charged, and declining it counts towards no probe (the planner learns from it)."""
    planner = DraftPlanner(ForwardCosts((1, 5), (1.0, 1.2)))
    for _ in range(10):
        planner.record([1], 1, 1, next_token=0, key=1)
    planner.observe_drafter_seconds(1.0)  # each drafted token costs a target step
    assert planner.choose(1, key=1, free=False) == 0  # verifying (1.05) and drafting (1) cost more than they gain
    assert planner.choose(1, key=1, free=False, drafted=1) == 1  # with it drafted, verifying it pays
    stale = DraftPlanner(STEEP)
    assert [stale.choose(3, free=False, drafted=1) for _ in range(2 * PROBE_EVERY)] == [0] * (2 * PROBE_EVERY)


def test_drafting_pays_weighs_the_first_drafts_own_cost_over_the_keys_seen() -> None:
    """`choose_tree` treats a drafted first token as spent and verifies even a weak one; `drafting_pays` asks
    before that cost: a head right a third of the time whose step costs 0.3 of the target's does not pay where a
    2-token forward costs 1.1 steps (1.33 tokens for 1.4 steps), one right 80 % of the time does. Keys are
    weighted by how often they came up, and each drafter's key group answers for itself."""
    costs = ForwardCosts((1, 2, 4), (1.0, 1.1, 1.35))
    weak, strong = DraftPlanner(costs), DraftPlanner(costs)
    assert weak.drafting_pays(3)  # nothing seen yet: draft, and learn
    for planner, right_in in ((weak, (True, False, False)), (strong, (True, True, True, True, False))):
        planner.observe_drafter_seconds(0.3)
        for round_ in range(30):
            planner.choose_tree(1, key=2, drafted=1)
            planner.record([1], 1, int(right_in[round_ % len(right_in)]), next_token=0, key=2)
    assert weak.choose_tree(1, key=2, drafted=1)[0] == 1  # in hand, the weak draft is still verified
    assert not weak.drafting_pays(1) and strong.drafting_pays(1)
    assert weak.drafting_pays(1, key_group=100)  # another drafter's group has seen nothing yet
    for _ in range(60):  # a confident band that is nearly always right comes to dominate the weak head's rounds
        weak.choose_tree(1, key=5, drafted=1)
        weak.record([1], 1, 1, next_token=0, key=5)
    assert weak.drafting_pays(1)


def test_timed_forwards_correct_a_calibration_that_was_off() -> None:
    """Calibrated on a lucky moment, a 2-token verification looked nearly free (1.02 steps); this generation's timed
    forwards say 1.3, and a draft accepted a quarter of the time stops paying. A slower machine overall (every
    width timed at twice its calibration) leaves the ratios between widths alone."""
    lucky = ForwardCosts((1, 2), (1.0, 1.02))
    planner = DraftPlanner(lucky)
    for i in range(40):
        planner.record([1], 1, int(i % 4 == 0), next_token=0, key=1)
    assert planner.choose(1, key=1) == 1
    for _ in range(30):
        planner.observe_forward_seconds(1, 1.0)
        planner.observe_forward_seconds(2, 1.3)
    assert planner.relative(2) == pytest.approx(1.3, abs=0.05)
    assert planner.choose(1, key=1) == 0
    slower = DraftPlanner(lucky)
    for _ in range(30):
        slower.observe_forward_seconds(1, 2.0)
        slower.observe_forward_seconds(2, 2.04)
    assert slower.forward_seconds(1) == pytest.approx(2.0, rel=0.05) and slower.relative(2) == pytest.approx(1.02)


def test_the_loop_times_its_forwards_only_where_costs_were_measured() -> None:
    model = ContextKeyedTarget(vocab=12, seed=4)
    drafter = OracleDrafter([1, 2, *model.greedy([1, 2], 30)], vocab=12, corrupt=0.3)
    measured = SpeculativeDecoder(model, drafter, max_draft=4, adaptive=True)
    gen = measured.start([1, 2], 30)
    gen.result()
    planner = gen.planner
    assert planner is not None and planner.forward_seconds(1) != planner.costs.seconds(1)
    given = SpeculativeDecoder(model, drafter, max_draft=4, adaptive=True, costs=STEEP)
    gen = given.start([1, 2], 30)
    gen.result()
    assert gen.planner is not None
    assert gen.planner.forward_seconds(1) == STEEP.seconds(1)
    assert gen.planner.relative(2) == STEEP.relative(2)


def test_drafter_cost_makes_drafting_dearer() -> None:
    cheap = DraftPlanner(ForwardCosts((1, 5), (1.0, 1.2)))
    for _ in range(10):
        cheap.record([1] * 4, 4, 3, next_token=0)
    assert cheap.choose(4) > 0
    cheap.observe_drafter_seconds(5.0)  # each drafted token costs five target steps
    assert cheap.choose(4, free=False) == 0
    assert cheap.choose(4) > 0  # a lookup's proposal (ngram+mtp) is not charged the MTP head's drafting time


@settings(max_examples=120, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 11), min_size=1, max_size=30),
    max_new=st.integers(1, 40),
    seed=st.integers(0, 5),
    corrupt=st.sampled_from([0.0, 0.3, 1.0]),
    max_draft=st.integers(1, 8),
    steep=st.booleans(),
    eos=st.one_of(st.none(), st.integers(0, 11)),
)
def test_adaptive_loop_equals_greedy_and_feeds_every_token_once(prompt, max_new, seed, corrupt, max_draft, steep, eos):
    model = ContextKeyedTarget(vocab=12, seed=seed)
    expected = model.greedy(prompt, max_new, eos=eos)
    reference = prompt + model.greedy(prompt, max_new + 10)
    rec = RecordingTarget(ContextKeyedTarget(vocab=12, seed=seed))
    drafter = OracleDrafter(reference, vocab=12, corrupt=corrupt, seed=seed)
    dec = SpeculativeDecoder(
        rec,
        drafter,
        max_draft=max_draft,
        eos_token_ids=[] if eos is None else [eos],
        adaptive=True,
        costs=STEEP if steep else FLAT,
    )
    result = dec.generate(prompt, max_new)
    assert result.token_ids == expected
    lengths = result.metrics.draft_lengths
    assert len(lengths) == result.metrics.target_forwards == len(rec.forwards) - 1
    assert all(0 <= k <= max_draft for k in lengths)
    for (start, tokens), kept in zip(rec.forwards[1:], rec.rollbacks, strict=True):
        assert kept >= start + 1  # the pending token always survives its round
        assert len(tokens) - 1 in lengths


def test_adaptive_loop_falls_back_to_plain_steps_when_drafts_always_fail() -> None:
    model = ContextKeyedTarget(vocab=12, seed=1)
    prompt = [1, 2, 3]
    reference = prompt + model.greedy(prompt, 80)
    drafter = OracleDrafter(reference, vocab=12, corrupt=1.0, seed=1)
    dec = SpeculativeDecoder(ContextKeyedTarget(vocab=12, seed=1), drafter, max_draft=6, adaptive=True, costs=STEEP)
    result = dec.generate(prompt, 60)
    assert result.token_ids == model.greedy(prompt, 60)
    assert sum(result.metrics.draft_lengths[-20:]) == 0


def test_a_fallback_drafters_misses_do_not_lower_another_drafters_estimates() -> None:
    """Keys a hundred apart (places in a fallback order) keep separate drafter-wide estimates: an MTP head that
    keeps missing (keys 100..) leaves a fresh n-gram key at the lookups' own rate."""
    planner = DraftPlanner(FLAT)
    for _ in range(20):
        planner.record([1, 1, 1], 3, 3, next_token=0, key=4)  # 4-gram lookups: all accepted
        planner.record([1, 1], 2, 0, next_token=0, key=100)  # the head: always wrong
    assert planner.acceptance(0, key=3) > 0.9  # a 3-gram match, never seen: the lookups' rate
    assert planner.acceptance(0, key=101) < 0.1  # another head key: the head's rate


def test_carried_acceptance_keeps_the_rates_and_caps_the_evidence() -> None:
    planner = DraftPlanner(FLAT)
    for _ in range(40):
        planner.record([1] * 4, 4, 3, next_token=0, key=3)
    fresh = DraftPlanner(FLAT, learned=planner.stats.carried())
    for position in range(4):
        assert fresh.acceptance(position, 3) == pytest.approx(planner.acceptance(position, 3), abs=0.03)
    assert fresh.acceptance(0, 3) > 0.9 > 0.3 > fresh.acceptance(3, 3)
    for _ in range(int(CARRY)):  # the text changes: a new request's own rounds soon outweigh what was carried
        for p in (fresh, planner):
            p.record([1], 1, 0, next_token=0, key=3)
    assert fresh.acceptance(0, 3) < planner.acceptance(0, 3) - 0.1


class WholeDrafter(OracleDrafter):
    """Drafts as much of the true continuation as it is asked for."""

    def draft(self, history: list[int], max_tokens: int) -> list[int]:
        return self.reference[len(history) : len(history) + max_tokens]


def test_a_decoders_next_generation_starts_from_what_the_last_one_learned() -> None:
    """A request whose drafts are all accepted no longer ramps its drafts up from the prior when the one before
    it taught the planner so; a fresh decoder does, and every output is greedy's."""
    model = ContextKeyedTarget(vocab=12, seed=4)
    prompt = [1, 2]
    expected = model.greedy(prompt, 40)
    drafter = WholeDrafter(prompt + model.greedy(prompt, 60), vocab=12, corrupt=0.0)
    dec = SpeculativeDecoder(model, drafter, max_draft=8, adaptive=True, costs=MILD)
    first, second = dec.generate(prompt, 40), dec.generate(prompt, 40)
    assert first.token_ids == second.token_ids == expected
    assert second.metrics.draft_lengths[0] > first.metrics.draft_lengths[0]
    assert second.metrics.target_forwards < first.metrics.target_forwards
    fresh = SpeculativeDecoder(model, drafter, max_draft=8, adaptive=True, costs=MILD).generate(prompt, 40)
    assert fresh.token_ids == expected and fresh.metrics.draft_lengths == first.metrics.draft_lengths
    # scopes (a server's tenants): another scope starts from the prior, its own scope from what it learned
    other = dec.start(prompt, 40, scope="bob").result()
    assert other.metrics.draft_lengths == first.metrics.draft_lengths
    assert dec.start(prompt, 40, scope="bob").result().metrics.draft_lengths == second.metrics.draft_lengths
    assert dec.start(prompt, 40, scope=None).result().metrics.draft_lengths == first.metrics.draft_lengths
    dec.forget("bob")
    assert dec.learned("bob") is None and dec.learned() is not None
    assert dec.start(prompt, 40, scope="bob").result().metrics.draft_lengths == first.metrics.draft_lengths


def test_a_key_with_a_stated_prior_starts_from_it_rather_than_its_groups_rate() -> None:
    """A drafter that knows a kind of match copies well (`Drafter.key_priors`) has it drafted in full from its
    first round, while the group's other keys keep the group's rate; its own rounds still correct it, and a carried
    copy keeps the priors."""
    planner = DraftPlanner(MILD, priors={6: 0.95})
    for _ in range(10):
        planner.record([1, 1, 1], 3, 0, next_token=0, key=2)  # shallow matches keep failing
    assert planner.acceptance(0, key=3) < 0.3  # another shallow key: the group's rate
    assert planner.acceptance(0, key=6) == pytest.approx(0.95)
    assert planner.choose(8, key=6) == 8 and planner.choose(8, key=3) == 0
    carried = DraftPlanner(MILD, learned=planner.stats.carried())
    assert carried.acceptance(4, key=6) == pytest.approx(0.95)
    for _ in range(6):
        planner.record([1, 1], 2, 0, next_token=0, key=6)
    assert planner.acceptance(0, key=6) < 0.5


class ConfidentDrafter(WholeDrafter):
    """`WholeDrafter`, stating that its proposals (key 0) are nearly always right."""

    key_priors = MappingProxyType({0: 0.95})


def test_a_drafters_stated_prior_sets_its_first_rounds_draft_length() -> None:
    """A fresh decoder whose drafter states a high prior for its key verifies the whole draft from the first round
    (one without ramps up from the default prior), and the output is greedy's either way."""
    model = ContextKeyedTarget(vocab=12, seed=4)
    prompt = [1, 2]
    expected = model.greedy(prompt, 40)
    reference = prompt + model.greedy(prompt, 60)
    sure = SpeculativeDecoder(model, ConfidentDrafter(reference, vocab=12, corrupt=0.0), max_draft=8, costs=MILD)
    plain = SpeculativeDecoder(model, WholeDrafter(reference, vocab=12, corrupt=0.0), max_draft=8, costs=MILD)
    confident, ramping = sure.generate(prompt, 40), plain.generate(prompt, 40)
    assert confident.token_ids == ramping.token_ids == expected
    assert confident.metrics.draft_lengths[0] == 8 > ramping.metrics.draft_lengths[0]
    assert confident.metrics.target_forwards < ramping.metrics.target_forwards
