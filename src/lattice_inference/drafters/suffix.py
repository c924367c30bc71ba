"""Suffix drafting: continuations from everything already seen in the generation's scope (``--method suffix``).

Prompt lookup (`NgramDrafter`) searches the request at hand. Agentic and repeated work (an agent re-reading and
re-editing the same file, a tool's output coming back as the next turn's input, answers regenerated, queries
against one schema) repeats *earlier requests*, so this drafter searches a `SuffixIndex` holding earlier requests'
prompts and outputs as well as the running request, which it adds itself to as tokens are accepted. Where the
matched context was followed by different continuations, the most frequent one is drafted and the others are
ranked beside it (`PlannedDraft.runners_up`): where the target verifies trees, the planner may verify them as
leaves in the same forward.

The drafter also runs the per-request prompt lookup (`NgramState`, with the ``ngram`` method's settings) and drafts
its proposal where the index has nothing better (`prefers_lookup`): on a single grounded request the index's
deepest, most recent occurrence of a short context is often a worse guess than the leftmost one prompt lookup
copies (a document converted or quoted in order), so ``suffix`` drafts what ``ngram`` would there, and from the
index where an earlier request matches deeper or several occurrences agree. Each source keeps its own planner keys.

The index comes from the generation (``Drafter.start(..., suffix_index=...)``): a `Generator` keeps one for all its
generations, ``lattice serve`` one per tenant; without one the drafter indexes the request alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from lattice_inference.drafters.base import Drafter, DrafterState, Plan, PlannedDraft, Proposal, Spelling
from lattice_inference.drafters.ngram import NgramDrafter, NgramState, validate_token_ids
from lattice_inference.drafters.suffix_index import MAX_MATCH, SuffixIndex, SuffixMatch, common_suffix
from lattice_inference.options import DecodeOptions, MatchPolicy, check_budget

if TYPE_CHECKING:
    from lattice_inference.sampling import Sampler

#: Match depths at which the planner key changes: deeper matches copy better, and keep their own statistics.
DEPTH_EDGES = (3, 4, 8, 16, MAX_MATCH)
AGREED = 10
"""Added to the planner key where at least two earlier occurrences agree on the first draft token."""
LOOKUP = 20
"""Added to the planner key where the draft is the request's own prompt-lookup match (keys 21..26: its depth band)."""
DEEP_PRIORS = {16: 0.9, MAX_MATCH: 0.95}
"""Acceptance the planner assumes for index matches at least this deep until their own rounds are seen
(`Drafter.key_priors`). A context repeated 32 tokens deep continues as before: on the shipped agentic traces every
position of 74 such rounds was accepted, and 0.93 of 46 rounds 16-31 deep, where the index's shallow matches ran at
0.6 [EPYC Zen 4, SmolLM2, bfloat16]; starting from the drafter-wide rate, a regenerated answer ramped its drafts
up 3, 4, 5, ... tokens a round."""


def match_key(match: SuffixMatch) -> int:
    """The planner key of a proposal: 1 + how many `DEPTH_EDGES` its match depth reaches, plus `AGREED` where its
    first token is backed by several occurrences (1..16: each kind of match learns its own acceptance)."""
    return 1 + sum(match.depth >= edge for edge in DEPTH_EDGES) + (AGREED if match.support >= 2 else 0)


def prefers_lookup(match: SuffixMatch, lookup_depth: int) -> bool:
    """Whether the request's own prompt-lookup proposal, whose occurrence matches the context ``lookup_depth``
    tokens deep (0: it proposes nothing), drafts rather than the index's ``match``: where it matches deeper, or as
    deep while no two of the index's occurrences agree on the next token (the leftmost occurrence is then the better
    guess, as ``ngram``'s ``first`` policy; several agreeing occurrences are the index's own evidence)."""
    if lookup_depth <= 0:
        return False
    return lookup_depth > match.depth or (lookup_depth == match.depth and match.support < 2)


class SuffixDrafter(Drafter):
    """Drafts the continuation that most often followed the context's longest matched suffix, in the
    generation's `SuffixIndex` (or, without one, a private index of ``budget`` tokens over the request alone), or
    the request's own prompt-lookup proposal where that matches at least as well (`prefers_lookup`; ``max_ngram``,
    ``min_ngram``, ``match``: its settings, as `NgramDrafter`'s). Each generation's sequence in the index and its
    lookup live in its `SuffixState`; the drafter keeps its settings only.

    Cost: ``extend`` indexes each token in O(1) (and O(max_ngram) for the lookup); ``propose`` is
    O(KEEP x (MAX_MATCH + max_draft)), flat in what the index holds (see `lattice_inference.drafters.suffix_index`).
    """

    proposes_trees = True

    def __init__(
        self,
        budget: int,
        max_draft: int = DecodeOptions.max_draft,
        eos_token_ids: Iterable[int] = (),
        *,
        max_ngram: int = DecodeOptions.max_ngram,
        min_ngram: int = DecodeOptions.min_ngram,
        match: MatchPolicy = DecodeOptions.match,
    ) -> None:
        check_budget(budget)
        self.lookup = NgramDrafter(max_ngram, min_ngram, max_draft, match, eos_token_ids)
        """The per-request prompt lookup each generation runs beside the index (it validates the shared settings)."""
        self.budget = budget
        self.max_draft = max_draft
        self.eos_token_ids = self.lookup.eos_token_ids
        self.key_priors = {
            match_key(SuffixMatch(depth=depth, support=support)): prior
            for depth, prior in DEEP_PRIORS.items()
            for support in (1, 2)
        }

    def new_state(
        self, prompt_ids: Sequence[int], sampler: Sampler | None = None, suffix_index: SuffixIndex | None = None
    ) -> SuffixState:
        """A generation over ``prompt_ids``, drafting from (and adding its tokens to) ``suffix_index``; None: a
        private index of this request."""
        prompt = validate_token_ids(prompt_ids, "prompt_ids")
        return SuffixState(self, suffix_index if suffix_index is not None else SuffixIndex(self.budget), prompt)


class SuffixState(DrafterState):
    """One generation's sequence in a `SuffixIndex` and its own prompt lookup (which holds its history); its tokens
    are added to both as accepted."""

    def __init__(self, drafter: SuffixDrafter, index: SuffixIndex, prompt: list[int]) -> None:
        self.drafter = drafter
        self.index = index
        """The index this generation drafts from and adds to."""
        self._sequence = index.begin(prompt)
        self._lookup = NgramState(drafter.lookup, prompt)
        self.last_match = SuffixMatch()
        """The latest proposal's match in the index (depth, support, runners-up)."""
        self.last_from_lookup = False
        """Whether the latest proposal was the request's own prompt lookup's rather than the index's."""

    def under_grammar(self, spelling: Spelling | None = None) -> None:
        """The request's own prompt lookup tries shorter n-grams and the text (`NgramState.under_grammar`)."""
        self._lookup.under_grammar(spelling)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append accepted tokens to the history and index them."""
        tokens = validate_token_ids(token_ids)
        self._lookup.extend(tokens)
        self.index.append(self._sequence, tokens)

    def _draft(self, max_tokens: int) -> tuple[list[int], int, list[list[int]]]:
        """This round's draft, its planner key and its runners-up (none for a prompt-lookup draft)."""
        drafter = self.drafter
        history = self._lookup.history
        match = self.index.match(history[-MAX_MATCH:], min(drafter.max_draft, max_tokens), drafter.eos_token_ids)
        self.last_match = match
        own, end = self._lookup.lookup(max_tokens)
        depth = common_suffix(history, end, history) if own else 0
        # the own lookup's text match (no occurrence, depth 0) drafts where the index has nothing
        self.last_from_lookup = prefers_lookup(match, depth) or bool(own and not match.draft)
        if self.last_from_lookup:
            return own, LOOKUP + match_key(SuffixMatch(depth=depth, support=1)), []
        return match.draft, match_key(match), match.runners_up

    def propose(self, max_tokens: int) -> Proposal:
        """The most frequent continuation of the context's longest matched suffix, or the request's own prompt
        lookup's where it matches as well (possibly empty)."""
        draft, key, _ = self._draft(max_tokens)
        return Proposal(draft, key)

    def propose_planned(self, max_tokens: int, plan: Plan) -> PlannedDraft:
        """The draft with its runners-up: the planner picks how much of the draft to verify and, where the target
        verifies trees, which runners-up to verify beside it (the proposal is free: its tokens count as drafted)."""
        draft, key, runners_up = self._draft(max_tokens)
        if not draft:
            return PlannedDraft([], [], key)
        width = max((len(r) for r in runners_up), default=0)
        k, leaves = plan.choose_tree(len(draft), key, drafted=len(draft), runners_up=width)
        alternatives = [runners_up[j][: leaves[j]] for j in range(k)] if any(leaves[:k]) else []
        while alternatives and not alternatives[-1]:
            alternatives.pop()
        return PlannedDraft(draft, draft[:k], key, runners_up=runners_up, alternatives=alternatives)
