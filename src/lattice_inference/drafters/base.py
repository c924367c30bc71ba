"""The drafter protocol: where draft tokens come from.

A drafter sees the whole token history (prompt, then every accepted token, in order) and proposes tokens that
may follow it. The decode loop verifies every proposal against the target model, so a drafter can never change
the output, only how many target forwards it takes to produce it.

Subclass `Drafter` to inherit the defaults of its optional parts (no hidden states, no model forwards, no use of
the sampler); the decode loop reads them directly, never by probing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from lattice_inference.drafters.suffix_index import SuffixIndex
    from lattice_inference.sampling import Sampler


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

    def observe_drafter_seconds(self, seconds_per_token: float) -> None:
        """One measured drafting time per drafted token."""
        ...


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


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens from the token history.

    Lifecycle per generation: ``use_sampler(sampler)``, ``reset(prompt)``, then alternately ``propose(k)`` and
    ``extend(tokens)`` with the tokens the verifier accepted (including the target's own correction or bonus
    token); where ``uses_hidden_states``, ``observe`` follows each ``extend`` (and the prompt) with the target's
    hidden states.
    """

    uses_hidden_states: bool = False
    """Whether the decode loop must capture the target's post-final-norm hidden states and pass them to
    `observe`."""

    forward_count: int = 0
    """Model forwards this drafter ran in the current generation (0 for lookup drafters)."""

    proposes_for_free: bool = True
    """Whether a proposal costs no model forward (lookup drafters): the adaptive loop then asks for the most it
    might verify and learns from the tokens it leaves unverified. Drafters that run a model say False and are
    asked for exactly the tokens the planner chose."""

    proposes_trees: bool = False
    """Whether a planned proposal may rank runners-up beside its draft tokens (`PlannedDraft.runners_up`), which the
    decoder may verify as a draft tree where the target can: it then lets the planner add leaves."""

    proposal_key: int = 0
    """A small integer grading how the latest proposal was made (n-gram lookup: the matched n-gram's length; an
    MTP head under the planner: its first draft's confidence band); the draft planner keeps acceptance statistics
    per key."""

    def reset(self, prompt_ids: Sequence[int]) -> None:
        """Start a new generation whose history is ``prompt_ids``."""
        ...

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append accepted tokens to the history."""
        ...

    def propose(self, max_tokens: int) -> list[int]:
        """Return up to ``max_tokens`` tokens likely to follow the history (possibly none)."""
        ...

    def propose_planned(self, max_tokens: int, plan: Plan) -> PlannedDraft:
        """This round's draft when a planner chooses its length. A free proposal is made at full length and the
        planner picks how much of it to verify; a drafter that runs a model is asked for the planned length only,
        and its time per drafted token is reported to the planner."""
        if self.proposes_for_free:
            proposal = self.propose(max_tokens)[:max_tokens]
            return PlannedDraft(proposal, proposal[: plan.choose(len(proposal), self.proposal_key)], self.proposal_key)
        k = plan.choose(max_tokens, self.proposal_key, free=False)
        if k == 0:
            return PlannedDraft([], [], self.proposal_key)
        start = time.perf_counter()
        proposal = self.propose(k)[:k]
        if proposal:
            plan.observe_drafter_seconds((time.perf_counter() - start) / len(proposal))
        return PlannedDraft(proposal, proposal, self.proposal_key)

    def observe(self, hidden_states: torch.Tensor, start_position: int) -> None:
        """Hidden states ``[n, hidden]`` of positions ``start_position .. start_position + n - 1``, in position
        order: after prefill (every prompt position) and after each verification (the accepted positions).
        Called only when ``uses_hidden_states``; the default ignores them."""

    def use_suffix_index(self, index: SuffixIndex | None) -> None:
        """The cross-request index of the generation about to start (called before `reset`): earlier requests'
        tokens in the generation's scope, which a drafter that reads them may draft from and adds its own tokens
        to (None: this request's tokens only). The default ignores it."""

    def use_sampler(self, sampler: Sampler) -> None:
        """The sampler of the generation about to start (called before `reset`). A drafter that scores tokens
        itself may draft with it (coupled drafting: the same keyed noise the target samples with); the default
        ignores it."""
