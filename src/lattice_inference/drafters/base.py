"""The drafter protocol: where draft tokens come from.

A drafter sees the whole token history (prompt, then every accepted token, in order) and proposes tokens that
may follow it. The decode loop verifies every proposal against the target model, so a drafter can never change
the output, only how many target forwards it takes to produce it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


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
