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

from lattice_inference.draft_planner import KEY_GROUP
from lattice_inference.drafters.base import Drafter, Plan, PlannedDraft
from lattice_inference.drafters.suffix_index import SuffixIndex
from lattice_inference.errors import ConfigError
from lattice_inference.sampling import Sampler


class FallbackDrafter(Drafter):
    """Asks ``drafters`` in order and returns the first non-empty proposal.

    ``proposals_by`` counts, per drafter (by position in ``drafters``), the rounds it drafted for.
    """

    def __init__(self, drafters: Sequence[Drafter]) -> None:
        if not drafters:
            raise ConfigError("a fallback drafter needs at least one drafter")
        self.drafters = list(drafters)
        self.uses_hidden_states = any(d.uses_hidden_states for d in self.drafters)
        self.proposes_for_free = all(d.proposes_for_free for d in self.drafters)
        self.proposes_trees = any(d.proposes_trees for d in self.drafters)
        self.proposals_by = [0] * len(self.drafters)
        self.proposal_key = 0

    @property
    def forward_count(self) -> int:  # type: ignore[override]  # a sum over the drafters, not a counter of its own
        """Model forwards the drafters ran (an n-gram lookup runs none)."""
        return sum(d.forward_count for d in self.drafters)

    def reset(self, prompt_ids: Sequence[int]) -> None:
        """Start a new generation in every drafter."""
        self.proposals_by = [0] * len(self.drafters)
        for d in self.drafters:
            d.reset(prompt_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append accepted tokens in every drafter."""
        for d in self.drafters:
            d.extend(token_ids)

    def observe(self, hidden_states: torch.Tensor, start_position: int) -> None:
        """Pass the target's hidden states to the drafters that read them."""
        for d in self.drafters:
            if d.uses_hidden_states:
                d.observe(hidden_states, start_position)

    def use_suffix_index(self, index: SuffixIndex | None) -> None:
        """Pass the generation's cross-request index to every drafter."""
        for d in self.drafters:
            d.use_suffix_index(index)

    def use_sampler(self, sampler: Sampler) -> None:
        """Pass the generation's sampler to every drafter."""
        for d in self.drafters:
            d.use_sampler(sampler)

    def propose(self, max_tokens: int) -> list[int]:
        """The first non-empty proposal of ``drafters``, in order (empty if none proposes). Its
        ``proposal_key`` is the proposing drafter's, offset by `KEY_GROUP` per place in the order (keys stay apart)."""
        for i, d in enumerate(self.drafters):
            draft = d.propose(max_tokens)
            if draft:
                self.proposals_by[i] += 1
                self.proposal_key = KEY_GROUP * i + d.proposal_key
                return draft
        return []

    def propose_planned(self, max_tokens: int, plan: Plan) -> PlannedDraft:
        """The first drafter whose planned draft is non-empty drafts, each planned under its own keys (offset as
        in `propose`). A free proposal the planner declines (its kind of match has been failing) passes the round
        to the next drafter, and is kept in ``skipped`` so the planner still learns whether it would have held."""
        skipped: list[tuple[list[int], int]] = []
        for i, d in enumerate(self.drafters):
            sub = d.propose_planned(max_tokens, _KeyOffset(plan, KEY_GROUP * i))
            key = KEY_GROUP * i + sub.key
            skipped += [(tokens, KEY_GROUP * i + k) for tokens, k in sub.skipped]
            if sub.verify:
                self.proposals_by[i] += 1
                self.proposal_key = key
                return replace(sub, key=key, skipped=skipped)
            if sub.proposal:
                skipped.append((sub.proposal, key))
        return PlannedDraft([], [], self.proposal_key, skipped)


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

    def observe_drafter_seconds(self, seconds_per_token: float) -> None:
        self.plan.observe_drafter_seconds(seconds_per_token)
