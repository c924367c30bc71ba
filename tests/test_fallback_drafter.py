"""`FallbackDrafter`: order of preference, and every drafter kept in step whether or not it drafted."""

from __future__ import annotations

import pytest
import torch

from lattice_inference.drafters.base import Drafter, DrafterState, Proposal
from lattice_inference.drafters.fallback import FallbackDrafter, FallbackState
from lattice_inference.errors import ConfigError


class Scripted(Drafter):
    """Proposes from a script of answers (under ``proposal_key``) and records everything it is told."""

    proposal_key = 0

    def __init__(self, answers: list[list[int]], hidden: bool = False) -> None:
        self.answers = answers
        self.uses_hidden_states = hidden
        self.asked = 0
        self.forwards = 0 if not hidden else 3

    def new_state(self, prompt_ids, sampler=None, suffix_index=None):
        return ScriptedState(self, prompt_ids)


class ScriptedState(DrafterState):
    def __init__(self, drafter: Scripted, prompt_ids) -> None:
        self.drafter = drafter
        self.history = list(prompt_ids)
        self.observed: list[tuple[int, int]] = []
        self.forwards = drafter.forwards
        self.proposes_for_free = drafter.proposes_for_free

    def extend(self, token_ids):
        self.history.extend(token_ids)

    def observe(self, hidden_states, start_position):
        self.observed.append((hidden_states.shape[0], start_position))

    def propose(self, max_tokens):
        drafter = self.drafter
        answer = drafter.answers[drafter.asked][:max_tokens]
        drafter.asked += 1
        return Proposal(answer, drafter.proposal_key)


def test_first_non_empty_proposal_wins_and_all_drafters_follow():
    first = Scripted([[1, 2], [], [], [7]])
    second = Scripted([[5, 6, 8], []], hidden=True)
    fb = FallbackDrafter([first, second])
    assert fb.uses_hidden_states
    state = fb.start([4, 4])
    assert isinstance(state, FallbackState)
    assert state.propose(4) == [1, 2]  # the second drafter is not asked
    assert second.asked == 0
    state.extend([1, 3])
    state.observe(torch.zeros(2, 8), 2)
    assert state.propose(2) == [5, 6]  # first has nothing: the second drafts, capped at max_tokens
    assert state.propose(4) == []  # nobody proposes
    assert state.propose(4) == [7]
    assert state.proposals_by == [2, 1]
    mine, theirs = state.states
    assert isinstance(mine, ScriptedState) and isinstance(theirs, ScriptedState)
    assert mine.history == theirs.history == [4, 4, 1, 3]
    assert theirs.observed == [(2, 2)] and mine.observed == []
    assert state.forward_count == 3
    state = fb.start([1])
    assert isinstance(state, FallbackState)
    assert state.proposals_by == [0, 0] and [s.history for s in state.states] == [[1], [1]]


def test_needs_a_drafter():
    with pytest.raises(ConfigError, match="at least one drafter"):
        FallbackDrafter([])
    assert not FallbackDrafter([Scripted([[1]])]).uses_hidden_states


class Costly(Scripted):
    """A scripted drafter that runs a model (the planner asks it for the planned length only)."""

    proposes_for_free = False


def test_planned_fallback_plans_each_drafter_under_its_own_key():
    """A lookup proposal whose kind of match keeps failing is declined and passed over (kept for the planner to
    learn from); the model drafter then drafts the length planned under its own key, not the lookup's."""
    from lattice_inference.draft_planner import DraftPlanner
    from lattice_inference.targets.facts import ForwardCosts

    planner = DraftPlanner(ForwardCosts((1, 2, 9), (1.0, 1.1, 1.5)))
    for _ in range(20):
        planner.record([1, 1, 1], 3, 0, next_token=0, key=2)  # lookups with a 2-gram match: always wrong
        planner.record([1, 1], 2, 1, next_token=0, key=100)  # the model drafter: first token right
    lookup = Scripted([[9, 9, 9, 9]])
    lookup.proposal_key = 2
    model = Costly([[5, 6, 7, 8]])
    fb = FallbackDrafter([lookup, model])
    state = fb.start([0])
    assert isinstance(state, FallbackState)
    planned = state.propose_planned(4, planner)
    assert planned.skipped == [([9, 9, 9, 9], 2)]
    assert planned.key == 100 and state.key == 100 and state.proposals_by == [0, 1]
    assert planned.verify == planned.proposal == [5, 6, 7, 8][: planner.choose(4, 100, free=False)]
    assert 1 <= len(planned.verify) < 4  # the second position fails: it is not worth the full width


def test_adaptive_fallback_uses_the_model_drafter_where_lookups_fail():
    """End to end: lookups that are always wrong come first; the planner learns to pass them over and the good
    drafter behind them does the drafting. Output is greedy's either way."""
    from lattice_inference.decode import SpeculativeDecoder
    from lattice_inference.targets.facts import ForwardCosts

    from .helpers import ContextKeyedTarget, OracleDrafter

    model = ContextKeyedTarget(vocab=12, seed=2)
    prompt = [1, 2, 3]
    reference = prompt + model.greedy(prompt, 90)
    bad = OracleDrafter(reference, vocab=12, corrupt=1.0, seed=2)
    good = OracleDrafter(reference, vocab=12, corrupt=0.0, seed=3)
    good.proposes_for_free = False
    costs = ForwardCosts((1, 2, 9), (1.0, 1.1, 1.5))
    dec = SpeculativeDecoder(model, FallbackDrafter([bad, good]), max_draft=6, adaptive=True, costs=costs)
    gen = dec.start(prompt, 80)
    result = gen.result()
    assert result.token_ids == model.greedy(prompt, 80)
    assert result.metrics.accepted_tokens > 30
    state = gen.drafter_state
    assert isinstance(state, FallbackState)
    assert state.proposals_by[1] > 2 * state.proposals_by[0]


def test_a_fallback_passes_the_model_drafters_tree_on_under_its_key():
    """ngram+mtp with draft trees: when the lookup has nothing, the MTP side's runners-up and chosen leaves come
    through with the round, under the fallback's key for that drafter."""
    from lattice_inference.draft_planner import DraftPlanner
    from lattice_inference.targets.facts import ForwardCosts

    from .helpers import TreeOracleDrafter

    tree = TreeOracleDrafter(list(range(40)), vocab=50, seed=4)
    fb = FallbackDrafter([Scripted([[]]), tree])
    state = fb.start([0, 1])
    assert isinstance(state, FallbackState)
    planned = state.propose_planned(3, DraftPlanner(ForwardCosts((1, 8), (1.0, 1.0)), max_leaves=4))
    assert planned.key == 100 + 1 and state.proposals_by == [0, 1]
    assert planned.alternatives and planned.alternatives == planned.runners_up[: len(planned.verify)]
