"""The drafter protocol: where draft tokens come from.

A drafter proposes tokens that may follow a sequence's token history (prompt, then every accepted token, in
order). The decode loop verifies every proposal against the target model, so a drafter can never change the
output, only how many target forwards it takes to produce it.

A `Drafter` is long-lived and holds configuration (and what is genuinely shared across requests: trained head
weights, a tenant's suffix index passed in per generation); what it learns about one sequence lives in the
`DrafterState` that `Drafter.start` returns, which the generation owns. So one drafter can serve several
generations at once, each through its own state.

Subclass `Drafter` and `DrafterState` to inherit the defaults of their optional parts (no hidden states, no model
forwards, no use of the sampler); the decode loop reads them directly, never by probing.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from lattice_inference.drafters.suffix_index import SuffixIndex
    from lattice_inference.sampling import Sampler


class Spelling(Protocol):
    """A tokenizer's bytes (llguidance's ``LLTokenizer`` is one): what tokens spell, and how it spells bytes."""

    def decode_bytes(self, tokens: list[int]) -> bytes:
        """The bytes ``tokens`` spell."""
        ...

    def tokenize_bytes(self, data: bytes) -> list[int]:
        """The tokens the tokenizer spells ``data`` with."""
        ...


class Plan(Protocol):
    """What a drafter asks of the adaptive planner (`lattice_inference.draft_planner.DraftPlanner` is one)."""

    def choose(self, available: int, key: int = 0, *, free: bool = True, drafted: int = 0) -> int:
        """How many of ``available`` tokens proposed under ``key`` to verify (``free``: the proposal cost nothing;
        ``drafted``: how many of a costly proposal's tokens are drafted already, their cost spent)."""
        ...

    def choose_tree(
        self, available: int, key: int = 0, *, drafted: int = 0, runners_up: int = 0
    ) -> tuple[int, list[int]]:
        """A costly proposal's draft length ``k`` (as `choose`) and how many of the ``runners_up`` next-best tokens
        the drafter has at each of the ``k`` depths to verify beside it (a draft tree; none where the target cannot
        verify trees)."""
        ...

    def drafting_pays(self, available: int, key_group: int = 0, *, runners_up: int = 0) -> bool:
        """Whether drafting a costly proposal's first token is expected to pay for itself, before it is drafted
        (`choose_tree` decides once it is, its cost spent). ``key_group``: a key of the drafter's group."""
        return True

    def observe_drafter_seconds(self, seconds_per_token: float) -> None:
        """One measured drafting time per drafted token."""
        ...


class Proposal(list[int]):
    """Draft tokens (a plain list of them, as far as comparisons go) and the planner ``key`` they were proposed
    under: a small integer grading how the proposal was made (n-gram lookup: the matched n-gram's length; a suffix
    match: its depth band; an MTP head under the planner: its first draft's confidence band). The draft planner
    keeps acceptance statistics per key."""

    key: int

    def __init__(self, tokens: Iterable[int] = (), key: int = 0) -> None:
        super().__init__(tokens)
        self.key = key


@dataclass
class PlannedDraft:
    """One round's draft under the planner: what was proposed, the part to verify, the key to learn under, and
    free proposals passed over this round (``(tokens, key)``; the planner still learns from their first token).

    A drafter that ranks its tokens (an MTP head) may also return, per drafted depth, its next-best tokens
    (``runners_up``, all it computed: the planner learns how often they hold) and the leading ones of them to
    verify beside the draft (``alternatives``, one list per verified depth): the target then verifies a tree whose
    spine is ``verify`` with those alternatives as leaves, and one may stand in for a rejected draft token.
    """

    proposal: list[int]
    verify: list[int]
    key: int = 0
    skipped: list[tuple[list[int], int]] = field(default_factory=list)
    runners_up: list[list[int]] = field(default_factory=list)
    alternatives: list[list[int]] = field(default_factory=list)


class DrafterState:
    """What a drafter knows about one sequence (its history, indexes over it, a head's KV cache, counters), made by
    `Drafter.start` and owned by the generation: alternately `propose` (or `propose_planned`) and `extend` with the
    tokens the verifier accepted (including the target's own correction or bonus token); where the drafter
    ``uses_hidden_states``, `observe` follows each `extend` (and the prompt) with the target's hidden states.
    """

    forwards: int = 0
    """Model forwards a drafter that runs one has run for this sequence (it counts them here)."""

    proposes_for_free: bool = True
    """As `Drafter.proposes_for_free` (the default `propose_planned` reads it here)."""

    @property
    def forward_count(self) -> int:
        """Model forwards drafted for this sequence so far (0 for lookup drafters)."""
        return self.forwards

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append accepted tokens to the history."""
        raise NotImplementedError

    def propose(self, max_tokens: int) -> Proposal:
        """Up to ``max_tokens`` tokens likely to follow the history (possibly none), with their planner key."""
        raise NotImplementedError

    def under_grammar(self, spelling: Spelling | None = None) -> None:
        """The generation is constrained by a grammar (structured output), whose fixed spans repeat token for token
        and whose values copy the prompt's text in other tokens (``"Madrid`` begins ``"Mad`` where the prompt has
        `` Madrid``): a drafter may draft from shorter contexts and from the text its tokens spell (`NgramState`,
        with ``spelling``). Called once, before the first proposal; by default nothing changes."""

    def propose_planned(self, max_tokens: int, plan: Plan) -> PlannedDraft:
        """This round's draft when a planner chooses its length. A free proposal is made at full length and the
        planner picks how much of it to verify; a drafter that runs a model is asked for the planned length only,
        and its time per drafted token is reported to the planner."""
        if self.proposes_for_free:
            proposal = self.propose(max_tokens)
            tokens = proposal[:max_tokens]
            return PlannedDraft(tokens, tokens[: plan.choose(len(tokens), proposal.key)], proposal.key)
        k = plan.choose(max_tokens, 0, free=False)  # a costly proposal's key is known only once it is made
        if k == 0:
            return PlannedDraft([], [])
        start = time.perf_counter()
        proposal = self.propose(k)
        tokens = proposal[:k]
        if tokens:
            plan.observe_drafter_seconds((time.perf_counter() - start) / len(tokens))
        return PlannedDraft(tokens, tokens, proposal.key)

    def observe(self, hidden_states: torch.Tensor, start_position: int) -> None:
        """Hidden states ``[n, hidden]`` of positions ``start_position .. start_position + n - 1``, in position
        order: after prefill (every prompt position) and after each verification (the accepted positions).
        Called only when the drafter ``uses_hidden_states``; the default ignores them."""


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens from a token history; its per-sequence knowledge lives in `DrafterState`s.

    Per generation the decode loop calls ``start(prompt, sampler=..., suffix_index=...)`` once and then drives the
    returned state (see `DrafterState`). The drafter itself keeps configuration only, so generations started on
    it never share what they learn; it holds no request's state, not even the latest one's.
    """

    uses_hidden_states: bool = False
    """Whether the decode loop must capture the target's post-final-norm hidden states and pass them to
    `DrafterState.observe`."""

    proposes_for_free: bool = True
    """Whether a proposal costs no model forward (lookup drafters): the adaptive loop then asks for the most it
    might verify and learns from the tokens it leaves unverified. Drafters that run a model say False and are
    asked for exactly the tokens the planner chose."""

    proposes_trees: bool = False
    """Whether a planned proposal may rank runners-up beside its draft tokens (`PlannedDraft.runners_up`), which the
    decoder may verify as a draft tree where the target can: it then lets the planner add leaves."""

    key_priors: Mapping[int, float] = MappingProxyType({})
    """Acceptance the planner assumes for a planner key before that key's own rounds are seen, where the drafter
    knows better than its drafter-wide estimate (a suffix match 32 tokens deep continues as before); keys not
    here start from that estimate (`lattice_inference.acceptance`)."""

    def new_state(
        self, prompt_ids: Sequence[int], sampler: Sampler | None, suffix_index: SuffixIndex | None
    ) -> DrafterState:
        """A fresh state over ``prompt_ids`` (what `start` returns; implement this, call `start`)."""
        ...

    def start(
        self,
        prompt_ids: Sequence[int],
        *,
        sampler: Sampler | None = None,
        suffix_index: SuffixIndex | None = None,
    ) -> DrafterState:
        """Begin drafting for a generation whose history is ``prompt_ids`` and return its state.

        ``sampler``: the generation's sampler (None: greedy); a drafter that scores tokens itself may draft with it
        (coupled drafting: the same keyed noise the target samples with). ``suffix_index``: the generation's
        cross-request index, earlier requests' tokens in its scope, which a drafter that reads them may draft from
        and add the generation's tokens to (None: this request's tokens only). Drafters that use neither ignore
        them."""
        return self.new_state(prompt_ids, sampler, suffix_index)
