"""Acceptance rule: which draft tokens the target agrees with.

The verification forward over ``[pending] + draft`` yields the target's own *choice* after every prefix (greedy
argmax, or the keyed sampler's token for that sequence index: see `lattice_inference.sampling`). Draft token
``i`` is accepted while it equals the target's choice at row ``i``; the choice at the first disagreement (or
after the last draft token, the "bonus") is emitted too, so every round emits ``accepted + 1`` tokens, exactly
the tokens plain decoding would choose at those indices. With a deterministic draft token ``d`` and keyed
sampling, ``d`` is accepted with probability ``p(d)``, the most any deterministic draft can get.

A draft *tree* (`DraftTree`) adds leaves beside the draft: alternatives to the draft token at some depths. Each
fed row attends to its own ancestors only and sits at the position of its depth, so every row's choice is the
target's choice after the path to it; the accepted path follows the draft while it matches, then may step onto
the one leaf equal to the target's choice there (distinct tokens: at most one can be), whose row chooses the
bonus. Whatever the leaves hold, the emitted tokens are the target's own choices along the path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one draft."""

    accepted: int
    """How many leading draft tokens the target agreed with."""
    tokens: list[int]
    """The tokens to emit: the accepted draft tokens, then the target's correction or bonus token."""
    rows: list[int] | None = None
    """The fed rows of the accepted path (the pending token's row 0 first), where a tree's leaf was taken; None
    for a prefix of the draft (rows ``0 .. accepted``)."""

    @property
    def path(self) -> list[int]:
        """The fed rows of the accepted path: what the target keeps, and whose hidden states the drafter gets."""
        return self.rows if self.rows is not None else list(range(self.accepted + 1))

    @property
    def on_draft(self) -> int:
        """How many accepted tokens are the draft's own (not a tree's leaf)."""
        return self.accepted - (self.rows is not None)


@dataclass(frozen=True)
class DraftTree:
    """A draft with leaves: ``alternatives[j]`` are other tokens for the draft's depth ``j`` (0-based; children of
    the draft token at ``j - 1``, or of the pending token), one list per draft depth or fewer.

    Fed rows: the pending token (row 0), the draft (rows ``1..k``), then the leaves, depth by depth: a draft
    that is accepted as a prefix keeps rows ``0..a`` of the cache in place, as a chain does."""

    draft: list[int]
    alternatives: list[list[int]]

    def __post_init__(self) -> None:
        if len(self.alternatives) > len(self.draft):
            raise ValueError(f"{len(self.alternatives)} alternative lists for a draft of {len(self.draft)} tokens")
        for depth, leaves in enumerate(self.alternatives):
            if self.draft[depth] in leaves or len(set(leaves)) != len(leaves):
                raise ValueError(f"alternatives at depth {depth} must be distinct from each other and the draft")

    def rows(self, pending: int) -> tuple[list[int], list[int], list[int]]:
        """``(tokens, parents, depths)`` of the fed rows: ``parents[i]`` is row ``i``'s parent row (-1 for row 0),
        ``depths[i]`` how far past the pending token's position it sits."""
        tokens, parents, depths = (
            [pending, *self.draft],
            [-1, *range(len(self.draft))],
            list(range(len(self.draft) + 1)),
        )
        for depth, leaves in enumerate(self.alternatives):
            tokens += leaves
            parents += [depth] * len(leaves)
            depths += [depth + 1] * len(leaves)
        return tokens, parents, depths

    def verify(self, choices: Sequence[int]) -> Verdict:
        """The accepted path given ``choices[i]``, the target's choice after fed row ``i`` (`rows` order)."""
        width = len(self.draft) + 1 + sum(len(leaves) for leaves in self.alternatives)
        if len(choices) != width:
            raise ValueError(f"need {width} target choices for a draft tree of {width} rows, got {len(choices)}")
        verdict = verify_prefix(self.draft, choices[: len(self.draft) + 1])
        depth = verdict.accepted
        if depth >= len(self.alternatives) or choices[depth] not in self.alternatives[depth]:
            return verdict
        row = len(self.draft) + 1 + sum(len(leaves) for leaves in self.alternatives[:depth])
        row += self.alternatives[depth].index(choices[depth])
        tokens = [*self.draft[:depth], choices[depth], choices[row]]
        return Verdict(accepted=depth + 1, tokens=tokens, rows=[*range(depth + 1), row])


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n, end = 0, min(len(a), len(b))
    while n < end and a[n] == b[n]:
        n += 1
    return n


def verify_prefix(draft: Sequence[int], choices: Sequence[int]) -> Verdict:
    """Accept the longest prefix of ``draft`` that matches the target's ``choices``.

    ``choices[i]`` is the target's token after ``[pending] + draft[:i]``, so ``len(choices)`` must be
    ``len(draft) + 1``.
    """
    if len(choices) != len(draft) + 1:
        raise ValueError(f"need {len(draft) + 1} target choices for a draft of {len(draft)}, got {len(choices)}")
    accepted = common_prefix(draft, choices)
    return Verdict(accepted=accepted, tokens=[*draft[:accepted], choices[accepted]])
