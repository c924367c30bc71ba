"""Acceptance rule: which draft tokens the target agrees with.

The verification forward over ``[pending] + draft`` yields the target's own *choice* after every prefix (greedy
argmax, or the keyed sampler's token for that sequence index: see `lattice_inference.sampling`). Draft token
``i`` is accepted while it equals the target's choice at row ``i``; the choice at the first disagreement (or
after the last draft token, the "bonus") is emitted too, so every round emits ``accepted + 1`` tokens, exactly
the tokens plain decoding would choose at those indices. With a deterministic draft token ``d`` and keyed
sampling, ``d`` is accepted with probability ``p(d)``, the most any deterministic draft can get.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one draft."""

    accepted: int
    """How many leading draft tokens the target agreed with."""
    tokens: list[int]
    """The tokens to emit: the accepted draft tokens, then the target's correction or bonus token."""


def greedy_choices(logits: torch.Tensor) -> list[int]:
    """The target's greedy token after each row of ``logits`` (first index on ties, as ``torch.argmax``)."""
    return logits.argmax(dim=-1).tolist()


def verify_prefix(draft: Sequence[int], choices: Sequence[int]) -> Verdict:
    """Accept the longest prefix of ``draft`` that matches the target's ``choices``.

    ``choices[i]`` is the target's token after ``[pending] + draft[:i]``, so ``len(choices)`` must be
    ``len(draft) + 1``.
    """
    if len(choices) != len(draft) + 1:
        raise ValueError(f"need {len(draft) + 1} target choices for a draft of {len(draft)}, got {len(choices)}")
    accepted = 0
    for d, c in zip(draft, choices, strict=False):
        if d != c:
            break
        accepted += 1
    return Verdict(accepted=accepted, tokens=[*draft[:accepted], choices[accepted]])


#: The greedy-era name of `verify_prefix` (the rule is the same for every choice function).
verify_greedy = verify_prefix
