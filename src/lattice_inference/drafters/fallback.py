"""Several drafters in order of preference: each round, the first one that proposes anything drafts.

``ngram+mtp`` is the useful pairing: prompt lookup where the context already holds the continuation (a quote,
an edit of code in the prompt, a summary reusing phrases), the model's own MTP head everywhere else. Every
drafter sees every accepted token and hidden state, whether or not it drafted, so each stays exactly where it
would be on its own; the output is still the target's, token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from lattice_inference.acceptance import KEY_GROUP
from lattice_inference.drafters.base import Drafter, DrafterState, Plan, PlannedDraft, Proposal, Spelling
from lattice_inference.drafters.suffix_index import SuffixIndex
from lattice_inference.errors import ConfigError
from lattice_inference.sampling import Sampler


class FallbackDrafter(Drafter):
    """Asks ``drafters`` in order and returns the first non-empty proposal.

    A generation's `FallbackState` holds one state per drafter; ``proposals_by`` counts, per drafter (by position
    in ``drafters``), the rounds it drafted for in the most recently started generation.
    """

    def __init__(self, drafters: Sequence[Drafter]) -> None:
        if not drafters:
            raise ConfigError("a fallback drafter needs at least one drafter")
        self.drafters = list(drafters)
        self.uses_hidden_states = any(d.uses_hidden_states for d in self.drafters)
        self.proposes_for_free = all(d.proposes_for_free for d in self.drafters)
        self.proposes_trees = any(d.proposes_trees for d in self.drafters)
        self.key_priors = {KEY_GROUP * i + k: p for i, d in enumerate(self.drafters) for k, p in d.key_priors.items()}

    def new_state(
        self, prompt_ids: Sequence[int], sampler: Sampler | None = None, suffix_index: SuffixIndex | None = None
    ) -> FallbackState:
        """Start the generation in every drafter (each gets the sampler and the cross-request index)."""
        states = [d.start(prompt_ids, sampler=sampler, suffix_index=suffix_index) for d in self.drafters]
        return FallbackState(self, states)


class FallbackState(DrafterState):
    """One generation's fallback drafting: a state per drafter (every one sees every accepted token and hidden
    state, whether or not it drafted), and per drafter the rounds it drafted for."""

    def __init__(self, drafter: FallbackDrafter, states: list[DrafterState]) -> None:
        self.drafter = drafter
        self.states = states
        self.proposals_by = [0] * len(states)
        self.key = 0
        """The latest proposal's planner key."""

    def under_grammar(self, spelling: Spelling | None = None) -> None:
        """Every drafter's state learns that the generation is under a grammar."""
        for state in self.states:
            state.under_grammar(spelling)

    @property
    def forward_count(self) -> int:
        """Model forwards the drafters ran (an n-gram lookup runs none)."""
        return sum(s.forward_count for s in self.states)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append accepted tokens in every drafter."""
        for s in self.states:
            s.extend(token_ids)

    def observe(self, hidden_states: torch.Tensor, start_position: int) -> None:
        """Pass the target's hidden states to the drafters that read them."""
        for d, s in zip(self.drafter.drafters, self.states, strict=True):
            if d.uses_hidden_states:
                s.observe(hidden_states, start_position)

    def propose(self, max_tokens: int) -> Proposal:
        """The first non-empty proposal of the drafters, in order (empty if none proposes). Its key is the
        proposing drafter's, offset by `KEY_GROUP` per place in the order (keys stay apart)."""
        for i, s in enumerate(self.states):
            draft = s.propose(max_tokens)
            if draft:
                self.proposals_by[i] += 1
                self.key = KEY_GROUP * i + draft.key
                return Proposal(draft, self.key)
        return Proposal([], self.key)

    def propose_planned(self, max_tokens: int, plan: Plan) -> PlannedDraft:
        """The first drafter whose planned draft is non-empty drafts, each planned under its own keys (offset as
        in `propose`). A free proposal the planner declines (its kind of match has been failing) passes the round
        to the next drafter, and is kept in ``skipped`` so the planner still learns whether it would have held."""
        skipped: list[tuple[list[int], int]] = []
        for i, s in enumerate(self.states):
            sub = s.propose_planned(max_tokens, _KeyOffset(plan, KEY_GROUP * i))
            key = KEY_GROUP * i + sub.key
            skipped += [(tokens, KEY_GROUP * i + k) for tokens, k in sub.skipped]
            if sub.verify:
                self.proposals_by[i] += 1
                self.key = key
                return replace(sub, key=key, skipped=skipped)
            if sub.proposal:
                skipped.append((sub.proposal, key))
        return PlannedDraft([], [], self.key, skipped)


class _KeyOffset:
    """A `Plan` seen through a key offset (each place in a fallback order keeps its own statistics)."""

    def __init__(self, plan: Plan, offset: int) -> None:
        self.plan, self.offset = plan, offset

    def choose(self, available: int, key: int = 0, *, free: bool = True, drafted: int = 0) -> int:
        return self.plan.choose(available, key + self.offset, free=free, drafted=drafted)

    def choose_tree(
        self, available: int, key: int = 0, *, drafted: int = 0, runners_up: int = 0
    ) -> tuple[int, list[int]]:
        return self.plan.choose_tree(available, key + self.offset, drafted=drafted, runners_up=runners_up)

    def drafting_pays(self, available: int, key_group: int = 0, *, runners_up: int = 0) -> bool:
        return self.plan.drafting_pays(available, key_group + self.offset, runners_up=runners_up)

    def observe_drafter_seconds(self, seconds_per_token: float) -> None:
        self.plan.observe_drafter_seconds(seconds_per_token)
