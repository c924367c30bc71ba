"""Suffix drafting: continuations from everything already seen in the generation's scope (``--method suffix``).

Prompt lookup (`NgramDrafter`) searches the request at hand. Agentic and repeated work (an agent re-reading and
re-editing the same file, a tool's output coming back as the next turn's input, answers regenerated, queries
against one schema) repeats *earlier requests*, so this drafter searches a `SuffixIndex` holding earlier requests'
prompts and outputs as well as the running request, which it adds itself to as tokens are accepted. Where the
matched context was followed by different continuations, the most frequent one is drafted and the others are
ranked beside it (`PlannedDraft.runners_up`): where the target verifies trees, the planner may verify them as
leaves in the same forward.

The index comes from the generation (``Drafter.start(..., suffix_index=...)``): a `Generator` keeps one for all its
generations, ``lattice serve`` one per tenant; without one the drafter indexes the request alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from lattice_inference.drafters.base import Drafter, DrafterState, Plan, PlannedDraft, Proposal
from lattice_inference.drafters.ngram import validate_token_ids
from lattice_inference.drafters.suffix_index import MAX_MATCH, SuffixIndex, SuffixMatch
from lattice_inference.options import DecodeOptions, check_budget, check_positive

if TYPE_CHECKING:
    from lattice_inference.sampling import Sampler

#: Match depths at which the planner key changes: deeper matches copy better, and keep their own statistics.
DEPTH_EDGES = (3, 4, 8, 16, MAX_MATCH)
AGREED = 10
"""Added to the planner key where at least two earlier occurrences agree on the first draft token."""


def match_key(match: SuffixMatch) -> int:
    """The planner key of a proposal: 1 + how many `DEPTH_EDGES` its match depth reaches, plus `AGREED` where its
    first token is backed by several occurrences (1..16: each kind of match learns its own acceptance)."""
    return 1 + sum(match.depth >= edge for edge in DEPTH_EDGES) + (AGREED if match.support >= 2 else 0)


class SuffixDrafter(Drafter):
    """Drafts the continuation that most often followed the context's longest matched suffix, in the
    generation's `SuffixIndex` (or, without one, a private index of ``budget`` tokens over the request alone).
    Each generation's sequence in the index lives in its `SuffixState`; the drafter keeps its settings only.

    Cost: ``extend`` indexes each token in O(1); ``propose`` is O(KEEP x (MAX_MATCH + max_draft)), flat in what
    the index holds (see `lattice_inference.drafters.suffix_index`).
    """

    proposes_trees = True

    def __init__(
        self, budget: int, max_draft: int = DecodeOptions.max_draft, eos_token_ids: Iterable[int] = ()
    ) -> None:
        check_budget(budget)
        check_positive("max_draft", max_draft)
        self.budget = budget
        self.max_draft = max_draft
        self.eos_token_ids: frozenset[int] = frozenset(validate_token_ids(eos_token_ids, "eos_token_ids"))

    def new_state(
        self, prompt_ids: Sequence[int], sampler: Sampler | None = None, suffix_index: SuffixIndex | None = None
    ) -> SuffixState:
        """A generation over ``prompt_ids``, drafting from (and adding its tokens to) ``suffix_index``; None: a
        private index of this request."""
        prompt = validate_token_ids(prompt_ids, "prompt_ids")
        return SuffixState(self, suffix_index if suffix_index is not None else SuffixIndex(self.budget), prompt)


class SuffixState(DrafterState):
    """One generation's sequence in a `SuffixIndex`: its history, and its tokens added to the index as accepted."""

    def __init__(self, drafter: SuffixDrafter, index: SuffixIndex, prompt: list[int]) -> None:
        self.drafter = drafter
        self.index = index
        """The index this generation drafts from and adds to."""
        self._history = prompt
        self._sequence = index.begin(prompt)
        self.last_match = SuffixMatch()
        """The latest proposal's match (depth, support, runners-up)."""

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append accepted tokens to the history and index them."""
        tokens = validate_token_ids(token_ids)
        self._history.extend(tokens)
        self.index.append(self._sequence, tokens)

    def _match(self, max_tokens: int) -> SuffixMatch:
        drafter = self.drafter
        match = self.index.match(self._history[-MAX_MATCH:], min(drafter.max_draft, max_tokens), drafter.eos_token_ids)
        self.last_match = match
        return match

    def propose(self, max_tokens: int) -> Proposal:
        """The most frequent continuation of the context's longest matched suffix (possibly empty)."""
        match = self._match(max_tokens)
        return Proposal(match.draft, match_key(match))

    def propose_planned(self, max_tokens: int, plan: Plan) -> PlannedDraft:
        """The draft with its runners-up: the planner picks how much of the draft to verify and, where the target
        verifies trees, which runners-up to verify beside it (the proposal is free: its tokens count as drafted)."""
        match = self._match(max_tokens)
        draft, key = match.draft, match_key(match)
        if not draft:
            return PlannedDraft([], [], key)
        width = max(len(r) for r in match.runners_up)
        k, leaves = plan.choose_tree(len(draft), key, drafted=len(draft), runners_up=width)
        alternatives = [match.runners_up[j][: leaves[j]] for j in range(k)] if any(leaves[:k]) else []
        while alternatives and not alternatives[-1]:
            alternatives.pop()
        return PlannedDraft(draft, draft[:k], key, runners_up=match.runners_up, alternatives=alternatives)
