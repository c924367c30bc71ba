"""The drafter protocol: where draft tokens come from.

A drafter sees the whole token history (prompt, then every accepted token, in order) and proposes tokens that
may follow it. The decode loop verifies every proposal against the target model, so a drafter can never change
the output, only how many target forwards it takes to produce it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens from the token history.

    Lifecycle: ``reset(prompt)`` once per generation, then alternately ``propose(k)`` and ``extend(tokens)``
    with the tokens the verifier accepted (including the target's own correction or bonus token).
    """

    def reset(self, prompt_ids: Sequence[int]) -> None:
        """Start a new generation whose history is ``prompt_ids``."""
        ...

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append accepted tokens to the history."""
        ...

    def propose(self, max_tokens: int) -> list[int]:
        """Return up to ``max_tokens`` tokens likely to follow the history (possibly none)."""
        ...


@runtime_checkable
class HiddenStateDrafter(Drafter, Protocol):
    """A drafter that also reads the target's post-final-norm hidden states (an MTP head, for instance).

    The decode loop switches the target's hidden capture on when ``uses_hidden_states`` is true and calls
    ``observe`` after prefill (every prompt position) and after each verification (the accepted positions),
    always in position order.
    """

    uses_hidden_states: bool

    def observe(self, hidden_states: torch.Tensor, start_position: int) -> None:
        """Hidden states ``[n, hidden]`` of positions ``start_position .. start_position + n - 1``."""
        ...
