"""Adaptive drafting: how many draft tokens to verify this round (0 = a plain decoding step).

A round that verifies ``k`` draft tokens emits ``1 + a`` tokens, where ``a`` is how many of them the target
accepts, and costs one forward of ``k + 1`` tokens (plus the drafter's own work). With ``p_j`` the chance that
draft position ``j`` is accepted once positions ``1..j-1`` were, the expected yield is
``E(k) = 1 + p_1 + p_1 p_2 + ... + p_1...p_k``, and the planner picks the ``k`` with the most expected tokens
per second, ``E(k) / (cost(k + 1) + k * drafter_cost)``, where ``cost`` is the target's forward cost, calibrated
once per model (`ForwardCosts`) and corrected by the forwards each generation times. When drafts keep failing,
``k = 0`` wins and the round is plain decoding.

``p_j`` is learned online (`lattice_inference.acceptance`): exponentially decayed counts of offered and accepted
tokens at each position, kept separately for each *key* the drafter reports with its proposal (for n-gram lookup,
the length of the matched n-gram: longer matches copy better) and blended with the estimate over all of that
drafter's keys at that position, which starts from a prior; each generation starts from what the decoder's
previous one learned, capped so that its own rounds soon outweigh it. A lookup proposal is free, so the planner
also learns from the positions it did not verify: when every verified token is accepted, the target's next token
shows whether the next draft token would have been, which lets a planner that stopped drafting notice when
drafting would pay again.

Draft trees (`choose_tree`, where the target verifies them): a drafter that ranks its tokens offers, at each draft
depth ``j``, runners-up to its draft token there. Verified as leaves beside it, a runner-up of rank ``r`` adds one
token when the draft is accepted up to depth ``j - 1``, rejected at ``j``, and the target's token is that
runner-up: ``reach_{j-1} (1 - p_j) q_{j,r}``, where ``q_{j,r}`` (learned like ``p``, per key, depth and rank,
from every round in which the draft failed at a depth whose runners-up were ranked, verified or not) is the chance
of the latter once the draft token failed. Distinct tokens exclude each other, so gains add up; each leaf widens
the forward by one row, and leaves are added, best gain first, while the rate grows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lattice_inference.acceptance import KEY_GROUP, AcceptanceStats
from lattice_inference.targets.facts import ForwardCosts

__all__ = ["KEY_GROUP", "PROBE_EVERY", "DraftPlanner"]

GAIN_MARGIN = 0.25
"""A longer draft must promise more throughput by this fraction of its added cost to be preferred: one costing 8 %
more to verify and draft needs 2 % more tokens per second. Where verification is flat (a wider forward costs
what a narrower one does) any gain is taken, so the planner drafts as far as fixed drafts would; ties go to less
work."""
COST_PRIOR_WEIGHT = 4.0
"""How many timed forwards of a width the calibrated cost is worth (`DraftPlanner.observe_forward_seconds`)."""
COST_DECAY = 0.99
"""Weight kept by older timed forwards at each new one (costs drift more slowly than acceptance)."""
PROBE_EVERY = 16
"""After this many plain rounds in a row, a drafter whose proposals cost a forward drafts one token anyway, so
the planner sees whether its acceptance came back (lookup drafters need no probe: their unverified proposals
are checked for free)."""


class DraftPlanner:
    """Chooses each round's draft length from learned acceptance and measured verification cost.

    One planner per generation. ``costs`` is the target's `ForwardCosts`; ``drafter_cost`` the drafter's cost
    per drafted token in one-token target forwards (0 for lookup drafters); ``learned``: the acceptance to start
    from (`AcceptanceStats.carried` of the decoder's previous generation; None: the prior, and ``priors``, the
    drafter's `Drafter.key_priors`, for the keys it states them for).
    """

    def __init__(
        self,
        costs: ForwardCosts,
        drafter_cost: float = 0.0,
        *,
        max_leaves: int = 0,
        learned: AcceptanceStats | None = None,
        priors: Mapping[int, float] | None = None,
    ) -> None:
        self.costs = costs
        self.drafter_cost = drafter_cost
        self.max_leaves = max_leaves
        """Most runners-up `choose_tree` verifies in a round (0: never a tree; the decoder sets it where the target
        verifies trees)."""
        self.stats = learned if learned is not None else AcceptanceStats(priors)
        """Acceptance learned so far (with what the decoder carried in from earlier generations)."""
        self.shared_rows = 0
        """Rows of other sequences in the forward this round shares (a batched step; 0 alone): see `share`."""
        self.shared_tokens = 0.0
        """Tokens those rows are expected to give (see `share`)."""
        self._plain_rounds = 0
        self._drift = [0.0, 0.0]  # decayed count and sum of timed / calibrated seconds, every width
        self._timed: dict[int, list[float]] = {}  # the same, per width

    def share(self, rows: int, tokens: float | None = None) -> None:
        """Plan the next round as part of a forward that also holds ``rows`` rows of other sequences (a batched
        step), expected to give ``tokens`` tokens (default ``rows``; a batch counts each other sequence's pending
        token, whose row always gives one, and not their drafts): a round of ``w`` rows then costs the step's
        widening to ``rows + w`` rows, and it is weighed by the step's tokens per second, its own and the others'.
        With ``rows`` 0, a round alone, the plan is exactly the unbatched one. As the step fills and wider forwards
        cost more per row, drafts shrink, down to none."""
        self.shared_rows = rows
        self.shared_tokens = float(rows if tokens is None else tokens)

    def _cost(self, width: int) -> float:
        """Cost in one-token forwards of a forward holding this round's ``width`` rows (and the shared ones)."""
        return self.relative(self.shared_rows + width)

    def observe_drafter_seconds(self, seconds_per_token: float) -> None:
        """Fold one measured drafting time per token into ``drafter_cost`` (a running average)."""
        cost = seconds_per_token / self.forward_seconds(1)
        self.drafter_cost = cost if self.drafter_cost == 0.0 else 0.8 * self.drafter_cost + 0.2 * cost

    def observe_forward_seconds(self, width: int, seconds: float) -> None:
        """One timed target forward of ``width`` tokens in this generation. The calibration is a few forwards on
        a short context, and on a busy machine its width ratios can be off by as much as the margins the planner
        weighs; the forwards the generation runs anyway correct it (`forward_seconds`)."""
        ratio = seconds / self.costs.seconds(width)
        for counts in (self._drift, self._timed.setdefault(width, [0.0, 0.0])):
            counts[0] = counts[0] * COST_DECAY + 1.0
            counts[1] = counts[1] * COST_DECAY + ratio

    def forward_seconds(self, width: int) -> float:
        """Estimated seconds of a ``width``-token forward: the calibrated cost, scaled by how this generation's
        timed forwards of that width compare with it. A width not timed yet takes the ratio over every width
        (the machine got busier or the context longer), so the ratios between widths come from timed forwards
        only, never from drift alone."""
        drift = (COST_PRIOR_WEIGHT + self._drift[1]) / (COST_PRIOR_WEIGHT + self._drift[0])
        count, total = self._timed.get(width, (0.0, 0.0))
        return self.costs.seconds(width) * (COST_PRIOR_WEIGHT * drift + total) / (COST_PRIOR_WEIGHT + count)

    def relative(self, width: int) -> float:
        """Cost of a ``width``-token forward in one-token forwards (`forward_seconds`)."""
        return self.forward_seconds(width) / self.forward_seconds(1)

    def acceptance(self, position: int, key: int = 0) -> float:
        """Estimated chance that draft position ``position`` (0-based) is accepted once the earlier ones were."""
        return self.stats.acceptance(position, key)

    def alternative(self, depth: int, rank: int, key: int = 0) -> float:
        """Estimated chance that the runner-up of ``rank`` (0: the best after the draft token) at draft position
        ``depth`` (0-based) is the target's token, once the draft token there failed."""
        return self.stats.alternative(depth, rank, key)

    def choose_tree(
        self, available: int, key: int = 0, *, drafted: int = 0, runners_up: int = 0
    ) -> tuple[int, list[int]]:
        """`choose` for a costly proposal whose every depth has ``runners_up`` ranked next-best tokens: the draft
        length ``k`` and, per depth ``0..k-1``, how many runners-up to verify as leaves beside it (the module
        docstring has the rule; at most ``max_leaves`` in all). Without leaves it is `choose` exactly."""
        if drafted:
            self.stats.note_key(key)
        k = self.choose(available, key, free=False, drafted=drafted)
        drafting = max(0, k - drafted) * self.drafter_cost
        chain = (k, self.shared_tokens + self._yield(k, key), self._cost(k + 1) + drafting)
        best_k, best_leaves, _, _ = self._tree(available, key, chain, drafted, runners_up)
        if best_k and not k:
            self._plain_rounds = 0
        return best_k, best_leaves

    def drafting_pays(self, available: int, key_group: int = 0, *, runners_up: int = 0) -> bool:
        """Whether drafting a costly proposal's first token pays for itself: the tokens per one-token forward
        expected of a round that drafts it (its cost, then the plan `choose_tree` would make under each key the
        drafter's rounds have had, weighted by how often each came up lately) against a plain round's one.

        `choose_tree` is asked once the first token is drafted, its cost spent, and verifying even a weak draft
        beats discarding it; this is the decision before that cost. A head whose drafts are right about a third of
        the time on grounded text took 1.7 plain steps a round for 1.35 tokens where verification is not flat
        [EPYC Zen 4]. ``key_group``: any key of the drafter's group (`KEY_GROUP`). Until a key was seen: yes."""
        seen = self.stats.seen.get(key_group // KEY_GROUP)
        if not seen:
            return True
        tokens = cost = 0.0
        for key, weight in seen.items():
            chain = self._chain(available, key, self.drafter_cost, 1)
            _, _, expected, spent = self._tree(available, key, chain, 1, runners_up)
            tokens += weight * expected
            cost += weight * spent
        total = sum(seen.values())
        rate, cost = tokens / total, cost / total + self.drafter_cost
        plain = self._cost(1)
        return _better(rate / cost, cost, (1.0 + self.shared_tokens) / plain, plain)

    def _chain(self, available: int, key: int, per_token: float, drafted: int) -> tuple[int, float, float]:
        """The best draft length ``k`` of 0..``available`` under ``key`` (the most tokens per one-token forward,
        `_better`), with its expected tokens and its cost in one-token forwards; ``per_token``: the drafting cost
        of each token past the ``drafted`` ones."""
        base = 1.0 + self.shared_tokens
        best_k, best_expected, best_cost = 0, base, self._cost(1)
        expected, reach = base, 1.0
        for k in range(1, available + 1):
            reach *= self.acceptance(k - 1, key)
            expected += reach
            cost = self._cost(k + 1) + max(0, k - drafted) * per_token
            if _better(expected / cost, cost, best_expected / best_cost, best_cost):
                best_k, best_expected, best_cost = k, expected, cost
        return best_k, best_expected, best_cost

    def _tree(
        self, available: int, key: int, chain: tuple[int, float, float], drafted: int, runners_up: int
    ) -> tuple[int, list[int], float, float]:
        """The best tree against the best ``chain`` (its ``k``, expected tokens and cost): the draft length, the
        leaves per depth, the expected tokens and the cost (leaves added best gain first while the rate grows)."""
        k, best_expected, best_cost = chain
        best_k, best_leaves = k, [0] * k
        width = min(runners_up, self.max_leaves)
        if not width or not available:
            return best_k, best_leaves, best_expected, best_cost
        per_token = self.drafter_cost
        for depth_count in range(1, available + 1):
            gains, reach, expected = [], 1.0, 1.0 + self.shared_tokens
            for depth in range(depth_count):
                p = self.acceptance(depth, key)
                gains += [(reach * (1 - p) * self.alternative(depth, r, key), depth) for r in range(width)]
                reach *= p
                expected += reach
            gains.sort(reverse=True)
            leaves = [0] * depth_count
            drafting = max(0, depth_count - drafted) * per_token
            for n, (gain, depth) in enumerate(gains[: self.max_leaves], start=1):
                expected += gain
                leaves[depth] += 1
                cost = self._cost(depth_count + 1 + n) + drafting
                if _better(expected / cost, cost, best_expected / best_cost, best_cost):
                    best_k, best_leaves, best_expected, best_cost = depth_count, list(leaves), expected, cost
        return best_k, best_leaves, best_expected, best_cost

    def _yield(self, k: int, key: int) -> float:
        """``E(k)``: expected tokens of a round verifying ``k`` draft tokens (no leaves)."""
        expected, reach = 1.0, 1.0
        for position in range(k):
            reach *= self.acceptance(position, key)
            expected += reach
        return expected

    def choose(self, available: int, key: int = 0, *, free: bool = True, drafted: int = 0) -> int:
        """How many of ``available`` draft tokens to verify (0..available). ``free``: whether the proposal cost
        nothing (otherwise every `PROBE_EVERY`-th round that would be plain drafts one token). ``drafted``: how
        many of a costly proposal's tokens are drafted already (an MTP head's first draft, drafted to read its
        confidence): their cost is spent whatever the choice, and a declined one is learned from like a free
        proposal, so it needs no probe."""
        best_k = self._chain(available, key, 0.0 if free else self.drafter_cost, drafted)[0]
        if best_k or not available:
            self._plain_rounds = 0
            return best_k
        if free or drafted:  # a declined proposal already in hand neither counts towards nor resets the probe
            return 0
        self._plain_rounds += 1
        if self._plain_rounds >= PROBE_EVERY:
            self._plain_rounds = 0
            return 1
        return 0

    def record(self, proposal: Sequence[int], verified: int, accepted: int, next_token: int, key: int = 0) -> None:
        """Learn from one round: ``verified`` tokens of ``proposal`` were checked and ``accepted`` of them taken;
        ``next_token`` is the target's own token after them. Where everything verified was accepted and the
        proposal had more, ``next_token`` also says whether the next proposed token would have been."""
        outcomes = [True] * accepted
        if accepted < verified:
            outcomes.append(False)
        elif verified < len(proposal):
            outcomes.append(proposal[verified] == next_token)
        for position, ok in enumerate(outcomes):
            self.stats.add(position, ok, key)

    def record_runners_up(
        self, runners_up: Sequence[Sequence[int]], depth: int, target_token: int, key: int = 0
    ) -> None:
        """Learn from one round in which the draft token at position ``depth`` (0-based) failed, verified or not,
        and the target's token there was ``target_token``: whether each ranked runner-up there would have held."""
        if depth >= len(runners_up):
            return
        for rank, token in enumerate(runners_up[depth]):
            self.stats.add_runner_up(depth, rank, token == target_token, key)


def _better(rate: float, cost: float, best_rate: float, best_cost: float) -> bool:
    """Whether a plan with ``rate`` (tokens per one-token forward) at ``cost`` beats the best so far (see
    `GAIN_MARGIN`)."""
    return rate > best_rate * (1.0 + GAIN_MARGIN * max(0.0, cost / best_cost - 1.0)) * (1.0 + 1e-9)
