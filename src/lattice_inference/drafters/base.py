"""The drafter protocol: where draft tokens come from.

A drafter sees the whole token history (prompt, then every accepted token, in order) and proposes tokens that
may follow it. The decode loop verifies every proposal against the target model, so a drafter can never change
the output, only how many target forwards it takes to produce it.

Subclass `Drafter` to inherit the defaults of its optional parts (no hidden states, no model forwards, no use of
the sampler); the decode loop reads them directly, never by probing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from lattice_inference.sampling import Sampler


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

    proposal_key: int = 0
    """A small integer grading how the latest proposal was made (n-gram lookup: the matched n-gram's length);
    the draft planner keeps acceptance statistics per key."""

    def reset(self, prompt_ids: Sequence[int]) -> None:
        """Start a new generation whose history is ``prompt_ids``."""
        ...

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append accepted tokens to the history."""
        ...

    def propose(self, max_tokens: int) -> list[int]:
        """Return up to ``max_tokens`` tokens likely to follow the history (possibly none)."""
        ...

    def observe(self, hidden_states: torch.Tensor, start_position: int) -> None:
        """Hidden states ``[n, hidden]`` of positions ``start_position .. start_position + n - 1``, in position
        order: after prefill (every prompt position) and after each verification (the accepted positions).
        Called only when ``uses_hidden_states``; the default ignores them."""

    def use_sampler(self, sampler: Sampler) -> None:
        """The sampler of the generation about to start (called before `reset`). A drafter that scores tokens
        itself may draft with it (coupled drafting: the same keyed noise the target samples with); the default
        ignores it."""


#: Kept for callers of the earlier name: every drafter may read hidden states now (see `Drafter`).
HiddenStateDrafter = Drafter
