"""The target protocol: the model being accelerated.

A target owns the model's cache and the position of the next write. ``forward`` feeds tokens at explicit,
contiguous positions starting at ``length`` and returns logits for every one of them; ``rollback`` moves the
write position back so that rejected draft tokens leave no trace. Positions are never implicit: the token at
index ``i`` of the sequence is always fed at position ``i``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Target(Protocol):
    """A causal LM that can score several tokens in one forward and roll its cache back."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model accepts as input."""
        ...

    @property
    def max_positions(self) -> int | None:
        """Largest sequence length the model supports, or ``None`` when unbounded or unknown."""
        ...

    @property
    def length(self) -> int:
        """Number of tokens in the cache; the next token fed goes to this position."""
        ...

    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Reset the cache, feed ``token_ids`` at positions ``0..n-1`` and return the last position's logits
        as a float tensor of shape ``[vocab]``."""
        ...

    def forward(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Feed ``token_ids`` at positions ``length..length+k-1`` and return logits ``[k, vocab]``."""
        ...

    def rollback(self, length: int) -> None:
        """Discard every cached token at position ``>= length`` (``0 <= length <= self.length``)."""
        ...
