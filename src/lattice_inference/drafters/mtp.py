"""MTP drafting: a model's own multi-token-prediction head proposes the next tokens (vLLM-equivalent protocol).

The head's step at position ``t`` takes the target's post-final-norm hidden ``h_t`` and the token ``x_{t+1}``
and predicts ``x_{t+2}``; further draft steps chain the head's own post-norm hidden. The head keeps its own KV
cache, one slot per position. Slots built from *target* hiddens are kept; slots built while chaining drafts are
rolled back before the next proposal and rebuilt from the target hiddens of the positions that were accepted, so
the head always sees exactly what it would see after plain decoding.

This drafter needs the target's hidden states: the decode loop passes them through `MtpState.observe` after
prefill and after every verification (``uses_hidden_states`` tells it to).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence

import torch

from lattice_inference.drafters.base import Drafter, DrafterState, Plan, PlannedDraft, Proposal
from lattice_inference.drafters.suffix_index import SuffixIndex
from lattice_inference.errors import ConfigError
from lattice_inference.mtp.head import DraftStep, MtpHead
from lattice_inference.sampling import Sampler


class MtpDrafter(Drafter):
    """Drafts with an `MtpHead`; ``num_drafts`` tokens per round (the reference's draft length minus one).

    ``coupled`` (default): when the generation samples, each draft token is chosen from the head's logits with the
    keyed noise the target will use at that sequence index (`Sampler.choose_draft`), so the draft follows the
    text being sampled; otherwise drafts are the head's argmax. The head's weights are shared by every generation;
    each generation's history, target hiddens and head KV cache live in its `MtpState`.
    """

    uses_hidden_states = True
    proposes_for_free = False
    proposes_trees = True

    def __init__(
        self,
        head: MtpHead,
        *,
        num_drafts: int | None = None,
        eos_token_ids: Sequence[int] = (),
        coupled: bool = True,
    ) -> None:
        num_drafts = head.config.num_drafts if num_drafts is None else num_drafts
        if num_drafts < 1:
            raise ConfigError(f"an MTP drafter needs at least 1 draft token per round, got {num_drafts}")
        self.head = head
        self.num_drafts = num_drafts
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.coupled = coupled

    def new_state(
        self, prompt_ids: Sequence[int], sampler: Sampler | None = None, suffix_index: SuffixIndex | None = None
    ) -> MtpState:
        """A generation over ``prompt_ids`` with its own head cache, drafting with ``sampler``'s keyed noise when
        it samples and the drafter is ``coupled``, by argmax otherwise."""
        coupled = sampler if self.coupled and sampler is not None and not sampler.greedy else None
        return MtpState(self, list(prompt_ids), coupled)


class MtpState(DrafterState):
    """One generation's MTP drafting: its history, the target hiddens not yet built into the head's cache, that
    cache (slots built from target hiddens are kept; those built while chaining drafts are rolled back before the
    next proposal) and the planner's back-off count."""

    proposes_for_free = False

    def __init__(self, drafter: MtpDrafter, prompt: list[int], sampler: Sampler | None) -> None:
        self.drafter = drafter
        self.head = drafter.head
        self.cache = drafter.head.new_cache()
        self._sampler = sampler
        self._history = prompt
        self._hidden: torch.Tensor | None = None  # target hiddens for positions _hidden_start ..
        self._hidden_start = 0
        self._pending: list[torch.Tensor] = []  # hiddens observed since, joined when a draft needs them
        self._hidden_end = 0  # the position after the last observed hidden
        self._committed = 0  # head cache slots built from target hiddens
        self._declined = 0  # planned rounds declined in a row
        self._unpaid = 0  # rounds in a row in which drafting was not expected to pay (`Plan.drafting_pays`)
        self._since_asked = ASK_EVERY - 1  # rounds since `Plan.drafting_pays` was last asked (the first round asks)
        self.forwards = 0

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append accepted tokens."""
        self._history.extend(int(t) for t in token_ids)

    def observe(self, hidden_states: torch.Tensor, start_position: int) -> None:
        """Record the target's post-norm hidden states for positions ``start_position ..`` (one row each). They
        are joined only when a draft needs them: rounds that do not draft (`propose_planned` backing off) copy
        nothing."""
        if self._hidden is None and not self._pending:
            self._hidden_start = self._hidden_end = start_position
        elif start_position != self._hidden_end:
            raise ValueError(
                f"hidden states must arrive in order: expected position {self._hidden_end}, got {start_position}"
            )
        self._pending.append(hidden_states.detach())
        self._hidden_end += int(hidden_states.shape[0])

    def _gather(self) -> torch.Tensor | None:
        """Every kept hidden row, from position ``_hidden_start``, as one tensor."""
        if self._pending:
            kept = [] if self._hidden is None else [self._hidden]
            self._hidden = torch.cat(kept + self._pending)
            self._pending = []
        return self._hidden

    def _row(self, position: int) -> torch.Tensor:
        assert self._hidden is not None
        return self._hidden[position - self._hidden_start]

    def propose(self, max_tokens: int) -> Proposal:
        """Catch the head's cache up over newly accepted positions, then chain up to ``max_tokens`` drafts."""
        drafts = Proposal()
        count = min(max_tokens, self.drafter.num_drafts)
        if count < 1:
            return drafts
        steps = self._chain(count, 0)
        for step in steps:
            drafts.append(step.token)
            if step.token in self.drafter.eos_token_ids or len(drafts) == count:
                break
        steps.close()
        self.forwards += len(drafts)
        return drafts

    def propose_planned(self, max_tokens: int, plan: Plan) -> PlannedDraft:
        """Draft the first token, let the planner choose the draft length under that draft's confidence bucket
        (`confidence_key`), and chain further drafts only if it wants them.

        Confident drafts are accepted far more often (the shipped SmolLM2 head, teacher-forced on held-out chat:
        see bench/RESULTS.md), so the planner drafts in confident rounds
        and skips the others, where one acceptance estimate for every round sat near break-even and under-drafted.
        A declined first draft is returned unverified, and the planner learns from it as from a free proposal. When
        the planner declines `BACK_OFF` rounds in a row (a head that does not fit the text), the first draft is
        drafted only every `BACK_OFF`-th round, until one is wanted again. The same holds while the planner expects
        drafting not to pay for its own cost (`Plan.drafting_pays`): once drafted, even a weak first draft is worth
        verifying, so declines alone never stop a head that costs more than its accepted tokens save.

        Each step also ranks `RUNNERS_UP` next-best tokens (free: the head scored them anyway). Where the target
        verifies draft trees the planner may verify some of them beside the draft token of their depth (the same
        head's second and third choices at the first draft are often right where its first is not), and it learns
        from every round how often they would have held.
        """
        count = min(max_tokens, self.drafter.num_drafts)
        if count < 1:
            return PlannedDraft([], [])
        if self._declined >= BACK_OFF and self._declined % BACK_OFF:  # backing off: a plain round
            self._declined += 1
            return PlannedDraft([], [])
        if self._unpaid:  # drafting did not pay when last asked: plain rounds until the next probe
            self._unpaid = (self._unpaid + 1) % BACK_OFF
            if self._unpaid:
                return PlannedDraft([], [])
        else:
            self._since_asked += 1
            if self._since_asked >= ASK_EVERY:
                self._since_asked = 0
                if not plan.drafting_pays(count, runners_up=RUNNERS_UP):
                    self._unpaid, self._since_asked = 1, ASK_EVERY - 1  # after the probe, ask again at once
                    return PlannedDraft([], [])
        behind = len(self._history) - 2 - self._committed  # positions the head's cache catches up on first
        start = time.perf_counter()
        steps = self._chain(count, RUNNERS_UP)
        first = next(steps, None)
        if first is None:
            return PlannedDraft([], [])
        key = confidence_key(first.confidence)
        k, leaves = plan.choose_tree(count, key, drafted=1, runners_up=len(first.runners_up))
        drafted = [first]
        while len(drafted) < k and drafted[-1].token not in self.drafter.eos_token_ids:
            step = next(steps, None)  # the chain is checked for room up to `count` steps; never None in practice
            if step is None:
                break
            drafted.append(step)
        steps.close()
        self.forwards += len(drafted)
        if behind <= count:  # a probe after plain rounds catches up on all of them: not a round's usual cost
            plan.observe_drafter_seconds((time.perf_counter() - start) / len(drafted))
        self._declined = 0 if k else self._declined + 1
        tokens = [step.token for step in drafted]
        runners_up = [list(step.runners_up) for step in drafted]
        verified = min(k, len(tokens))
        alternatives = [runners_up[j][: leaves[j]] for j in range(verified)] if any(leaves[:verified]) else []
        return PlannedDraft(tokens, tokens[:k], key, runners_up=runners_up, alternatives=alternatives)

    def _chain(self, limit: int, runners_up: int) -> Generator[DraftStep, None, None]:
        """The head's draft chain from the pending token, a `DraftStep` (with ``runners_up`` next-best tokens) per
        step; the caller stops it after at most ``limit`` steps (checked against the head's ``max_seq_len``). Its
        first step also fills the head's cache for positions accepted since the last round; it yields nothing
        before the target's hidden for the latest position has arrived."""
        last = len(self._history) - 2  # position whose hidden predicted the pending token
        hidden = self._gather()
        if hidden is None or last < self._committed:
            return
        self.cache.rollback_to(self._committed)
        catch_up = None
        if last > self._committed:  # slots for newly accepted positions, filled in the first draft forward
            lo, hi = self._committed - self._hidden_start, last - self._hidden_start
            catch_up = (hidden[lo:hi], self._history[self._committed + 1 : last + 1])
        steps = self.head.draft_steps(
            self._history[-1],
            last,
            self._row(last),
            catch_up=catch_up,
            rank=self._sampler.rank_draft if self._sampler is not None else None,
            runners_up=runners_up,
            limit=limit,
            cache=self.cache,
        )
        first = next(steps)  # the bookkeeping below must run even if the caller stops after this step
        self._committed = last + 1
        # Hidden rows before the committed slots are never needed again.
        drop = self._committed - 1 - self._hidden_start
        if drop > 256:
            self._hidden = hidden[drop:]
            self._hidden_start += drop
        yield first
        yield from steps


RUNNERS_UP = 3
"""Next-best tokens ranked at each draft step under the planner (candidate leaves of a draft tree)."""
BACK_OFF = 16
"""After this many declined rounds in a row, the first draft is drafted only every this many rounds."""
ASK_EVERY = 4
"""While drafting pays, `Plan.drafting_pays` is asked every this many rounds (it weighs every confidence band's
plan: ~0.2 ms, a step's 1-2 %; its answer moves slowly)."""
CONFIDENCE_EDGES = (0.4, 0.6, 0.8, 0.9)
"""Where the first draft's confidence (the head's top probability) changes planner key."""


def confidence_key(confidence: float) -> int:
    """The planner key of a round whose first draft has ``confidence``: 1 + the number of `CONFIDENCE_EDGES` it
    reaches (1..5; 0 stays the key of unplanned proposals), so each confidence band learns its own acceptance."""
    return 1 + sum(confidence >= edge for edge in CONFIDENCE_EDGES)
