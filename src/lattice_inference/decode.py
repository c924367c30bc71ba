"""The speculative decode loop: drafter -> target forward -> greedy verifier -> accepted tokens -> drafter.

Invariant: after prefill, the target's cache holds every token of the sequence except the newest one, the
*pending* token, which sits at position ``target.length``. Each round feeds ``[pending] + draft`` in one forward
(positions ``p .. p+k``), accepts the longest agreeing prefix ``a``, rolls the cache back to ``p + 1 + a`` and
emits ``a + 1`` tokens; the last of them becomes the new pending token. So every token is fed exactly once, at
the position equal to its index, and the output is token for token what plain greedy decoding emits.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from lattice_inference.drafters.base import Drafter
from lattice_inference.errors import ConfigError, TokenError
from lattice_inference.metrics import GenerationMetrics
from lattice_inference.targets.base import Target
from lattice_inference.verify import greedy_choices, verify_greedy


@dataclass
class GenerationResult:
    """Generated token ids (without a final EOS), why generation stopped, and its metrics."""

    token_ids: list[int]
    stop_reason: str
    """``"eos"`` when the model emitted an EOS token, ``"length"`` when ``max_new_tokens`` ran out."""
    metrics: GenerationMetrics


class SpeculativeDecoder:
    """Generates greedily from a `Target`, using a `Drafter` (or none: plain greedy decoding) to skip forwards.

    ``max_draft`` caps the tokens proposed per round. The decoder is reusable; ``metrics`` and
    ``stop_reason`` describe the most recent generation.
    """

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        *,
        max_draft: int = 4,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        if max_draft < 1:
            raise ConfigError(f"max_draft must be at least 1, got {max_draft}")
        self.target = target
        self.drafter = drafter
        self.max_draft = max_draft
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.metrics = GenerationMetrics()
        self.stop_reason = ""
        self._wants_hidden = False

    def _validate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        if not prompt_ids:
            raise TokenError("the prompt is empty: at least one token is needed")
        if max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be non-negative, got {max_new_tokens}")
        vocab = self.target.vocab_size
        for i, t in enumerate(prompt_ids):
            if not 0 <= t < vocab:
                raise TokenError(f"prompt token {i} has id {t}, outside the vocabulary of size {vocab}")
        limit = self.target.max_positions
        if limit is not None and len(prompt_ids) + max_new_tokens > limit:
            raise TokenError(
                f"prompt of {len(prompt_ids)} tokens plus max_new_tokens {max_new_tokens} = "
                f"{len(prompt_ids) + max_new_tokens} exceeds the model's {limit} positions"
            )

    def _emit(self, tokens: list[int], budget: int) -> list[int]:
        """Cut ``tokens`` at the budget and before the first EOS, recording why generation stops."""
        tokens = tokens[:budget]
        for i, t in enumerate(tokens):
            if t in self.eos_token_ids:
                self.stop_reason = "eos"
                return tokens[:i]
        if len(tokens) == budget:
            self.stop_reason = "length"
        return tokens

    def stream(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Iterator[list[int]]:
        """Yield the generated tokens in chunks, one chunk per verification round, as they are accepted.

        Stops after ``max_new_tokens`` tokens or at the first EOS token (which is not yielded).
        """
        prompt_ids = [int(t) for t in prompt_ids]
        self._validate(prompt_ids, max_new_tokens)
        m = self.metrics = GenerationMetrics(prompt_tokens=len(prompt_ids))
        self.stop_reason = "length"
        if max_new_tokens == 0:
            return
        target, drafter = self.target, self.drafter
        self._capture_hidden_if_needed()
        start = time.perf_counter()
        first, hidden = self._prefill(prompt_ids, max_new_tokens)
        m.prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        self.stop_reason = ""
        out = self._emit(first, max_new_tokens)
        m.new_tokens = len(out)
        if drafter is not None:
            self._inform_drafter(first, hidden, 0)
        try:
            if out:
                yield out
            pending = first[-1]
            while not self.stop_reason:
                remaining = max_new_tokens - m.new_tokens
                draft: list[int] = []
                if drafter is not None and remaining > 1:
                    draft = drafter.propose(min(self.max_draft, remaining - 1))[: remaining - 1]
                position = target.length
                verdict = verify_greedy(draft, greedy_choices(target.forward([pending, *draft])))
                hidden = self._hidden_rows(verdict.accepted + 1)  # before rollback, which may run the model
                target.rollback(position + 1 + verdict.accepted)
                m.record_round(len(draft), verdict.accepted)
                out = self._emit(verdict.tokens, remaining)
                m.new_tokens += len(out)
                self._inform_drafter(verdict.tokens, hidden, position)
                pending = verdict.tokens[-1]
                if out:
                    yield out
        finally:
            m.decode_s = time.perf_counter() - start
            m.drafter_forwards = int(getattr(drafter, "forward_count", 0))

    def _prefill(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor | None]:
        """Prefill the prompt; return the first emitted tokens and (if wanted) the prompt's hidden states.

        Where the target can verify a draft inside the prefill forward and the drafter needs no hidden states,
        the first draft is proposed from the prompt alone and verified there, saving one forward.
        """
        target, drafter = self.target, self.drafter
        if drafter is not None:
            drafter.reset(prompt_ids)
        fused = getattr(target, "prefill_with_draft", None)
        if drafter is None or self._wants_hidden or fused is None or max_new_tokens < 2:
            return [int(target.prefill(prompt_ids).argmax())], self._hidden_rows(len(prompt_ids))
        draft = drafter.propose(min(self.max_draft, max_new_tokens - 1))[: max_new_tokens - 1]
        verdict = verify_greedy(draft, greedy_choices(fused(prompt_ids, draft)))
        target.rollback(len(prompt_ids) + verdict.accepted)
        if draft:
            self.metrics.record_round(len(draft), verdict.accepted, in_prefill=True)
        return verdict.tokens, None

    def _capture_hidden_if_needed(self) -> None:
        """Switch the target's hidden-state capture on when the drafter reads hidden states."""
        self._wants_hidden = bool(getattr(self.drafter, "uses_hidden_states", False))
        if self._wants_hidden:
            if not hasattr(self.target, "capture_hidden"):
                name = type(self.target).__name__
                raise ConfigError(f"the drafter needs hidden states, which {name} cannot provide")
            self.target.capture_hidden = True

    def _hidden_rows(self, n: int) -> torch.Tensor | None:
        """The first ``n`` hidden-state rows of the target's last forward, if the drafter wants them."""
        return self.target.last_hidden[:n] if self._wants_hidden else None

    def _inform_drafter(self, tokens: list[int], hidden: torch.Tensor | None, position: int) -> None:
        """Hand accepted tokens (and the target hiddens of the positions that produced them) to the drafter."""
        if self.drafter is None:
            return
        self.drafter.extend(tokens)
        if hidden is not None:
            self.drafter.observe(hidden, position)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> GenerationResult:
        """Run `stream` to the end and return every generated token with the metrics."""
        tokens = [t for chunk in self.stream(prompt_ids, max_new_tokens) for t in chunk]
        return GenerationResult(token_ids=tokens, stop_reason=self.stop_reason, metrics=self.metrics)
