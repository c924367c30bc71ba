"""A request's predicted output as its draft (OpenAI's ``prediction``: the file an edit will mostly reproduce).

A client that knows most of the answer (an editor asking for an edit of a file it sends) hands it over as a
prediction. `PredictionState` follows it: a cursor at the prediction token the output should reach next; each
round drafts the prediction from the cursor on, and the target's verification keeps what the output really is, so
the output is token for token what the request gives without a prediction. Where the output departs from it (the
renamed identifier, the inserted line), the state finds where the output rejoins the prediction: the output's last
`REJOIN_NGRAM` tokens found again in the prediction, first after the cursor, else anywhere, and follows from there.
While it has nothing to offer (lost, or past its end) the request's own method drafts (``then``: `ngram`, `suffix`,
`mtp`), which sees every accepted token either way.

It counts what OpenAI's usage reports: ``accepted`` prediction tokens (drafted from the prediction and accepted) and
``rejected`` ones (drafted from it, verified and refused).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from lattice_inference.acceptance import KEY_GROUP
from lattice_inference.drafters.base import DrafterState, Plan, PlannedDraft, Proposal, Spelling
from lattice_inference.verify import common_prefix

REJOIN_NGRAM = 3
"""Tokens of the output's end looked up in the prediction to find where the output rejoins it after departing from
it (fewer at the output's very beginning)."""
PREDICTION_KEY = 9 * KEY_GROUP
"""The planner key of drafts from a prediction followed since its start or a rejoin at least `SETTLED` tokens back:
a group of its own (a fallback order's drafters take the first hundreds), so the method's misses never lower it."""
REJOINED_KEY = PREDICTION_KEY + 1
"""The planner key of drafts from a prediction just rejoined (fewer than `SETTLED` tokens followed since)."""
SETTLED = 8
"""Tokens followed since a rejoin after which the prediction's drafts count as settled (`PREDICTION_KEY`)."""
PREDICTION_PRIORS = {PREDICTION_KEY: 0.9, REJOINED_KEY: 0.6}
"""Acceptance the planner assumes for prediction drafts before it has seen their rounds: a prediction is what the
client expects the output to be, so its drafts start long (the planner learns the request's own rate)."""


class PredictionState(DrafterState):
    """One generation's prediction ``prediction`` (token ids) as its draft, ahead of ``then`` (the request's method's
    state; None: the prediction alone). See the module docstring."""

    def __init__(self, prediction: Sequence[int], then: DrafterState | None = None) -> None:
        self.prediction = [int(t) for t in prediction]
        self.then = then
        self.cursor: int | None = 0
        """Index of the prediction token the output should reach next (None: lost, looking for a rejoin)."""
        self.reached = 0
        """How far into the prediction the output had come where it last departed from it."""
        self.followed = SETTLED
        """Tokens the output has followed the prediction for since its start or last rejoin."""
        self.tail: list[int] = []
        """The last `REJOIN_NGRAM` tokens emitted (what a rejoin looks up)."""
        self.accepted = 0
        """Prediction tokens drafted and accepted."""
        self.rejected = 0
        """Prediction tokens drafted, verified and refused."""
        self._drafted: list[int] = []
        """The prediction tokens the last round verified (empty where the round's draft was not the prediction's)."""
        self._positions: dict[tuple[int, ...], list[int]] = {}
        """Where each `REJOIN_NGRAM`-gram of the prediction ends (exclusive), in order: the rejoin lookup."""
        n = REJOIN_NGRAM
        for end in range(n, len(self.prediction) + 1):
            self._positions.setdefault(tuple(self.prediction[end - n : end]), []).append(end)

    @property
    def forward_count(self) -> int:
        """Model forwards the method's drafter ran (following a prediction runs none)."""
        return self.then.forward_count if self.then is not None else 0

    def under_grammar(self, spelling: Spelling | None = None) -> None:
        """The method's state learns of the grammar (the prediction drafts as it is; the grammar cuts it)."""
        if self.then is not None:
            self.then.under_grammar(spelling)

    def observe(self, hidden_states: torch.Tensor, start_position: int) -> None:
        """Hidden states go to the method's state (an MTP head reads them)."""
        if self.then is not None:
            self.then.observe(hidden_states, start_position)

    def _ahead(self, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` prediction tokens from the cursor (none while lost)."""
        if self.cursor is None:
            return []
        return self.prediction[self.cursor : self.cursor + max_tokens]

    def _key(self) -> int:
        return PREDICTION_KEY if self.followed >= SETTLED else REJOINED_KEY

    def propose(self, max_tokens: int) -> Proposal:
        """The prediction from the cursor, else the method's proposal."""
        ahead = self._ahead(max_tokens)
        self._drafted = ahead
        if ahead or self.then is None:
            return Proposal(ahead, self._key())
        return self.then.propose(max_tokens)

    def propose_planned(self, max_tokens: int, plan: Plan) -> PlannedDraft:
        """The prediction from the cursor, as much of it as the planner chooses to verify; where it has nothing to
        offer, or the planner verifies none of it, the method's planned draft (the prediction's kept in ``skipped``
        for the planner to learn from)."""
        ahead = self._ahead(max_tokens)
        key = self._key()
        verify = ahead[: plan.choose(len(ahead), key)] if ahead else []
        self._drafted = verify
        if verify or self.then is None:
            return PlannedDraft(ahead, verify, key)
        planned = self.then.propose_planned(max_tokens, plan)
        if ahead:
            planned.skipped.append((ahead, key))
        return planned

    def extend(self, token_ids: Sequence[int]) -> None:
        """The round's emitted tokens: counted against the prediction's draft, the cursor moved along (or, where
        the output departed, to where it rejoins), and passed on to the method's state."""
        tokens = [int(t) for t in token_ids]
        if self._drafted:
            taken = common_prefix(self._drafted, tokens)
            self.accepted += taken
            self.rejected += len(self._drafted) - taken
            self._drafted = []
        self.tail = (self.tail + tokens)[-REJOIN_NGRAM:]
        if self.then is not None:
            self.then.extend(tokens)
        if self.cursor is not None:
            expected = self.prediction[self.cursor : self.cursor + len(tokens)]
            if expected == tokens:
                self.cursor += len(tokens)
                self.followed += len(tokens)
                return
            self.reached = self.cursor + common_prefix(expected, tokens)
        self.cursor = self._rejoin()
        self.followed = 0

    def _rejoin(self) -> int | None:
        """Where the output's last `REJOIN_NGRAM` tokens end in the prediction: the first place past ``reached``,
        else the first anywhere (None: nowhere)."""
        ends = self._positions.get(tuple(self.tail))  # none while fewer than REJOIN_NGRAM tokens were emitted
        if not ends:
            return None
        i = bisect.bisect_right(ends, self.reached)
        return ends[i] if i < len(ends) else ends[0]
