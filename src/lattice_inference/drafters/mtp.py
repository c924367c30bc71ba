"""MTP drafting: a model's own multi-token-prediction head proposes the next tokens (vLLM-equivalent protocol).

The head's step at position ``t`` takes the target's post-final-norm hidden ``h_t`` and the token ``x_{t+1}``
and predicts ``x_{t+2}``; further draft steps chain the head's own post-norm hidden. The head keeps its own KV
cache, one slot per position. Slots built from *target* hiddens are kept; slots built while chaining drafts are
rolled back before the next proposal and rebuilt from the target hiddens of the positions that were accepted, so
the head always sees exactly what it would see after plain decoding.

This drafter needs the target's hidden states: the decode loop passes them through `observe` after prefill and
after every verification (``uses_hidden_states`` tells it to).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lattice_inference.drafters.base import Drafter
from lattice_inference.errors import ConfigError
from lattice_inference.mtp.head import MtpHead
from lattice_inference.sampling import Sampler


class MtpDrafter(Drafter):
    """Drafts with an `MtpHead`; ``num_drafts`` tokens per round (the reference's draft length minus one).

    ``coupled`` (default): when the generation samples, each draft token is chosen from the head's logits with the
    keyed noise the target will use at that sequence index (`Sampler.choose_draft`), so the draft follows the
    text being sampled; otherwise drafts are the head's argmax.
    """

    uses_hidden_states = True
    proposes_for_free = False

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
        self.forward_count = 0
        self._sampler: Sampler | None = None
        self._history: list[int] = []
        self._hidden: torch.Tensor | None = None  # target hiddens for positions _hidden_start ..
        self._hidden_start = 0
        self._committed = 0  # head cache slots built from target hiddens

    def use_sampler(self, sampler: Sampler) -> None:
        """Draft with ``sampler``'s keyed noise when sampling and ``coupled``; by argmax otherwise."""
        self._sampler = sampler if self.coupled and not sampler.greedy else None

    def reset(self, prompt_ids: Sequence[int]) -> None:
        """Start a new generation over ``prompt_ids``."""
        self.head.reset_cache()
        self._history = list(prompt_ids)
        self._hidden = None
        self._hidden_start = 0
        self._committed = 0
        self.forward_count = 0

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append accepted tokens."""
        self._history.extend(int(t) for t in token_ids)

    def observe(self, hidden_states: torch.Tensor, start_position: int) -> None:
        """Record the target's post-norm hidden states for positions ``start_position ..`` (one row each)."""
        rows = hidden_states.detach()
        if self._hidden is None:
            self._hidden, self._hidden_start = rows, start_position
            return
        end = self._hidden_start + self._hidden.shape[0]
        if start_position != end:
            raise ValueError(f"hidden states must arrive in order: expected position {end}, got {start_position}")
        self._hidden = torch.cat([self._hidden, rows])

    def _row(self, position: int) -> torch.Tensor:
        assert self._hidden is not None
        return self._hidden[position - self._hidden_start]

    def propose(self, max_tokens: int) -> list[int]:
        """Catch the head's cache up over newly accepted positions, then chain up to ``max_tokens`` drafts."""
        count = min(max_tokens, self.num_drafts)
        last = len(self._history) - 2  # position whose hidden predicted the pending token
        if count < 1 or self._hidden is None or last < self._committed:
            return []
        head = self.head
        head.rollback_cache_to(self._committed)
        catch_up = None
        if last > self._committed:  # slots for newly accepted positions, filled in the first draft forward
            lo, hi = self._committed - self._hidden_start, last - self._hidden_start
            catch_up = (self._hidden[lo:hi], self._history[self._committed + 1 : last + 1])
        drafts = head.draft_tokens(
            self._history[-1],
            last,
            self._row(last),
            num_tokens=count,
            eos_token_ids=self.eos_token_ids,
            catch_up=catch_up,
            choose=self._sampler.choose_draft if self._sampler is not None else None,
        )
        self.forward_count += len(drafts)
        self._committed = last + 1
        # Hidden rows before the committed slots are never needed again.
        drop = self._committed - 1 - self._hidden_start
        if drop > 256:
            self._hidden = self._hidden[drop:]
            self._hidden_start += drop
        return drafts
