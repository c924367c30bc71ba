"""`FallbackDrafter`: order of preference, and every drafter kept in step whether or not it drafted."""

from __future__ import annotations

import pytest
import torch

from lattice_inference.drafters.base import Drafter
from lattice_inference.drafters.fallback import FallbackDrafter
from lattice_inference.errors import ConfigError


class Scripted(Drafter):
    """Proposes from a script of answers and records everything it is told."""

    def __init__(self, answers: list[list[int]], hidden: bool = False) -> None:
        self.answers = answers
        self.uses_hidden_states = hidden
        self.history: list[int] = []
        self.observed: list[tuple[int, int]] = []
        self.asked = 0
        self.forward_count = 0 if not hidden else 3

    def reset(self, prompt_ids):
        self.history = list(prompt_ids)

    def extend(self, token_ids):
        self.history.extend(token_ids)

    def observe(self, hidden_states, start_position):
        self.observed.append((hidden_states.shape[0], start_position))

    def propose(self, max_tokens):
        answer = self.answers[self.asked][:max_tokens]
        self.asked += 1
        return answer


def test_first_non_empty_proposal_wins_and_all_drafters_follow():
    first = Scripted([[1, 2], [], [], [7]])
    second = Scripted([[5, 6, 8], []], hidden=True)
    fb = FallbackDrafter([first, second])
    assert fb.uses_hidden_states
    fb.reset([4, 4])
    assert fb.propose(4) == [1, 2]  # the second drafter is not asked
    assert second.asked == 0
    fb.extend([1, 3])
    fb.observe(torch.zeros(2, 8), 2)
    assert fb.propose(2) == [5, 6]  # first has nothing: the second drafts, capped at max_tokens
    assert fb.propose(4) == []  # nobody proposes
    assert fb.propose(4) == [7]
    assert fb.proposals_by == [2, 1]
    assert first.history == second.history == [4, 4, 1, 3]
    assert second.observed == [(2, 2)] and first.observed == []
    assert fb.forward_count == 3
    fb.reset([1])
    assert fb.proposals_by == [0, 0] and first.history == second.history == [1]


def test_needs_a_drafter():
    with pytest.raises(ConfigError, match="at least one drafter"):
        FallbackDrafter([])
    assert not FallbackDrafter([Scripted([[1]])]).uses_hidden_states
