"""What the draft planner learns about acceptance, and carries from one generation of a decoder to the next.

For each *key* a drafter reports with its proposals (an n-gram match's length, a suffix match's depth band, an MTP
head's confidence band), exponentially decayed counts of offered and accepted draft tokens at each position: ``p_j``,
the chance that position ``j`` is accepted once positions ``0..j-1`` were, is the key's own rate blended with the
rate over its key group (a drafter's keys share a hundred, `KEY_GROUP`), which is blended with `PRIOR`; a key
whose drafter states a prior for it (`Drafter.key_priors`: a suffix match 32 tokens deep, accepted at every
position of 74 rounds on the shipped traces, where its group's rate was 0.6) blends its own counts with that
instead. Runners-up (draft trees) are counted alike per key, depth and rank, blended with `ALT_PRIORS`.

A decoder keeps what the last generation of each scope learned (`AcceptanceStats.carried`) and starts that
scope's next one from it, each count capped at `CARRY` observations so that a new request's own rounds soon
outweigh it: acceptance by key is mostly a property of the model and the drafter, and a request starting from the
prior ramps its drafts up one position per round (a regenerated answer, copied in full, verified 4, 6, 7, 8, 9, 10
tokens in its first six rounds [EPYC Zen 4]). Only rates by key travel, never text; ``lattice serve`` still keeps
them per tenant, as its suffix indexes, since a request's timing would show what another tenant's taught.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

PRIOR = 0.6
"""Acceptance assumed at every position before anything is observed."""
PRIOR_WEIGHT = 2.0
"""How many observations the prior is worth."""
KEY_WEIGHT = 3.0
"""How many observations the drafter-wide estimate is worth against one key's own counts."""
DECAY = 0.97
"""Weight kept by older observations at each new one (recent rounds count more: text changes its nature)."""
KEY_GROUP = 100
"""Keys that share a hundred share the estimate their own counts are blended with: a drafter's keys lie in one
hundred (`FallbackDrafter` offsets each place in its order by 100), so an MTP head's misses never lower the
estimates of n-gram matches, nor the reverse."""
ALT_PRIORS = (0.15, 0.08, 0.04)
"""Chance assumed that the runner-up of each rank (the last for any later one) holds where the draft token failed,
before anything is observed: less for each rank down (the shipped SmolLM2 head's second choice, teacher-forced on
chat: 0.19; third 0.11; fourth 0.06)."""
CARRY = 8.0
"""Most observations a count carried into a new generation is worth (its rate kept): about eight of the new
request's own rounds outweigh what earlier requests learned."""


@dataclass
class Counts:
    """Decayed counts of offered and accepted tokens by position (or by rank, for runners-up)."""

    offered: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def add(self, position: int, accepted: bool) -> None:
        while len(self.offered) <= position:
            self.offered.append(0.0)
            self.accepted.append(0.0)
        self.offered[position] = self.offered[position] * DECAY + 1.0
        self.accepted[position] = self.accepted[position] * DECAY + float(accepted)

    def rate(self, position: int, prior: float, weight: float) -> float:
        if position >= len(self.offered):
            return prior
        return (self.accepted[position] + weight * prior) / (self.offered[position] + weight)

    def capped(self, cap: float) -> Counts:
        """A copy in which each position weighs at most ``cap`` observations, its rate unchanged."""
        scale = [min(1.0, cap / offered) if offered > 0 else 1.0 for offered in self.offered]
        return Counts(
            [o * s for o, s in zip(self.offered, scale, strict=True)],
            [a * s for a, s in zip(self.accepted, scale, strict=True)],
        )


def _blend(group: Counts | None, counts: Counts | None, position: int, prior: float) -> float:
    """A key's estimate at ``position``: its own decayed counts, blended with its drafter-wide ``group`` estimate,
    which is blended with ``prior``."""
    base = prior if group is None else group.rate(position, prior, PRIOR_WEIGHT)
    return base if counts is None else counts.rate(position, base, KEY_WEIGHT)


class AcceptanceStats:
    """Acceptance learned online, by key and key group (drafted tokens by position; runners-up by depth and rank),
    and how often each key's rounds came up lately (``seen``: key group -> decayed count of drafted rounds)."""

    def __init__(self, priors: Mapping[int, float] | None = None) -> None:
        self.priors: Mapping[int, float] = priors or {}
        """Acceptance to start a key from instead of its key group's estimate (`Drafter.key_priors`)."""
        self._groups: dict[int, Counts] = {}
        self._by_key: dict[int, Counts] = {}
        self._alt_groups: dict[tuple[int, int], Counts] = {}  # (key group, depth) -> counts by rank
        self._alt_by_key: dict[tuple[int, int], Counts] = {}  # (key, depth) -> counts by rank
        self.seen: dict[int, dict[int, float]] = {}

    def carried(self, cap: float = CARRY) -> AcceptanceStats:
        """A copy to start the next generation from: every count capped at ``cap`` observations (`CARRY`)."""
        out = AcceptanceStats(self.priors)
        out._groups = {k: c.capped(cap) for k, c in self._groups.items()}
        out._by_key = {k: c.capped(cap) for k, c in self._by_key.items()}
        out._alt_groups = {k: c.capped(cap) for k, c in self._alt_groups.items()}
        out._alt_by_key = {k: c.capped(cap) for k, c in self._alt_by_key.items()}
        out.seen = {g: {k: min(w, cap) for k, w in keys.items()} for g, keys in self.seen.items()}
        return out

    def acceptance(self, position: int, key: int = 0) -> float:
        """Estimated chance that draft position ``position`` (0-based) is accepted once the earlier ones were: a
        key with a stated prior (`priors`) blends its own counts with that prior, any other with its group's
        estimate."""
        prior = self.priors.get(key)
        if prior is not None:
            counts = self._by_key.get(key)
            return prior if counts is None else counts.rate(position, prior, KEY_WEIGHT)
        return _blend(self._groups.get(key // KEY_GROUP), self._by_key.get(key), position, PRIOR)

    def alternative(self, depth: int, rank: int, key: int = 0) -> float:
        """Estimated chance that the runner-up of ``rank`` at draft position ``depth`` is the target's token, once
        the draft token there failed."""
        prior = ALT_PRIORS[min(rank, len(ALT_PRIORS) - 1)]
        return _blend(self._alt_groups.get((key // KEY_GROUP, depth)), self._alt_by_key.get((key, depth)), rank, prior)

    def add(self, position: int, accepted: bool, key: int) -> None:
        """Count one drafted (or, for a free proposal, checked) token at ``position`` under ``key``."""
        self._groups.setdefault(key // KEY_GROUP, Counts()).add(position, accepted)
        self._by_key.setdefault(key, Counts()).add(position, accepted)

    def add_runner_up(self, depth: int, rank: int, held: bool, key: int) -> None:
        """Count whether the runner-up of ``rank`` at ``depth`` would have held where the draft token failed."""
        self._alt_groups.setdefault((key // KEY_GROUP, depth), Counts()).add(rank, held)
        self._alt_by_key.setdefault((key, depth), Counts()).add(rank, held)

    def note_key(self, key: int) -> None:
        """Count one drafted round under ``key`` (decayed like the acceptance counts)."""
        seen = self.seen.setdefault(key // KEY_GROUP, {})
        for other in seen:
            seen[other] *= DECAY
        seen[key] = seen.get(key, 0.0) + 1.0
