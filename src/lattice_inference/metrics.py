"""Acceptance and speed metrics of one generation.

Definitions follow vLLM so numbers are comparable: a *draft* is a verification round with at least one drafted
token; *acceptance rate* is accepted drafted tokens over drafted tokens; *mean acceptance length* is
``1 + accepted / drafts`` (tokens emitted per drafted round, counting the target's own token).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class GenerationMetrics:
    """Counters and timings collected while generating; derived rates are properties."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens whose cache rows the prefill kept from the previous generation instead of computing them
    (``prefix_cache``; OpenAI's ``usage.prompt_tokens_details.cached_tokens``)."""
    new_tokens: int = 0
    target_forwards: int = 0
    """Target forward passes after prefill (one per verification round or plain step)."""
    drafts: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    """Drafted tokens the target accepted (excludes the target's own correction or bonus token)."""
    accepted_per_position: list[int] = field(default_factory=list, metadata={"merge": "by_position"})
    """``accepted_per_position[i]``: rounds in which draft position ``i`` was accepted."""
    drafted_per_position: list[int] = field(default_factory=list, metadata={"merge": "by_position"})
    """``drafted_per_position[i]``: rounds whose draft had a token at position ``i``."""
    draft_lengths: list[int] = field(default_factory=list, metadata={"merge": "concatenate"})
    """Tokens verified in each round, in order (0: a plain decoding step); the adaptive planner's choices."""
    leaves: int = 0
    """Runners-up verified as a draft tree's leaves beside the drafted tokens, over all rounds (not counted in
    ``drafted_tokens``: each stands in for a drafted token, at the drafted token's position)."""
    accepted_leaves: int = 0
    """Rounds in which a leaf was accepted in place of a rejected drafted token (counted in ``accepted_tokens``,
    at that drafted token's position)."""
    drafter_forwards: int = 0
    """Forward passes of a learned drafter (MTP head steps, catch-up batches included); 0 for n-gram lookup."""
    accepted_prediction_tokens: int = 0
    """Tokens of the request's prediction (OpenAI's predicted outputs) drafted and accepted."""
    rejected_prediction_tokens: int = 0
    """Tokens of the request's prediction drafted, verified and refused."""
    grammar_forced_tokens: int = 0
    """Tokens drafted because the request's grammar forced them (structured output; counted in ``drafted_tokens``)."""
    grammar_spelled_tokens: int = 0
    """Tokens drafted as a spelling of bytes the grammar forces past its forced tokens (``":"`` after a key): likely,
    not certain, so the model may reject them (counted in ``drafted_tokens``)."""
    grammar_cut_tokens: int = 0
    """Drafted tokens the grammar rejected: cut from their drafts before verification (not in ``drafted_tokens``)."""
    grammar_mask_s: float = 0.0
    """Seconds the grammar's masks cost: computing them, and under greedy telling a row's argmax allowed without
    one (`GrammarState.choose_greedy`; in ``decode_s``)."""
    prefill_s: float = 0.0
    decode_s: float = 0.0
    latency_s: float = 0.0
    """Seconds from the generation's making (a batch's request: its arrival) to its end, waiting included."""
    calibration_s: float = 0.0
    """Time spent measuring the target's forward costs for the draft planner and checking that its verification
    is decode-matched (first generation of a target only; counted in neither prefill nor decode)."""
    exact: bool | None = field(default=None, metadata={"merge": "all_known"})
    """Whether the target's self-check found every row of a k-token forward equal, bitwise, to the 1-token step
    (None: not checked: no drafter, or a target that does not claim it)."""
    exactness: str = field(default="", metadata={"merge": "first"})
    """The self-check's one-line report (which operation broke the identity, where one did)."""

    def record_round(
        self, drafted: int, accepted: int, *, in_prefill: bool = False, leaves: int = 0, on_leaf: bool = False
    ) -> None:
        """Count one verification round that drafted ``drafted`` tokens and accepted ``accepted`` of them
        (``in_prefill``: the draft was verified by the prefill forward, which is not counted as a target forward;
        ``leaves``: runners-up verified beside the draft, ``on_leaf``: the last accepted token was one)."""
        self.target_forwards += not in_prefill
        self.leaves += leaves
        self.accepted_leaves += on_leaf
        self.draft_lengths.append(drafted)
        if drafted == 0:
            return
        self.drafts += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        grow = drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(drafted):
            self.drafted_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def add(self, other: GenerationMetrics) -> None:
        """Add ``other``'s counts to these (several generations' totals, as ``lattice bench`` reports them).

        Every field is merged by the rule in its ``metadata["merge"]``, numbers by default (summed), so a new
        field is either summed or names its rule; one that is neither fails here rather than being dropped.
        """
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            rule = f.metadata.get("merge", "sum")
            if rule == "sum" and isinstance(mine, int | float) and not isinstance(mine, bool):
                setattr(self, f.name, mine + theirs)
            elif rule == "by_position":
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, value in enumerate(theirs):
                    mine[i] += value
            elif rule == "concatenate":
                mine.extend(theirs)
            elif rule == "all_known":
                known = [v for v in (mine, theirs) if v is not None]
                setattr(self, f.name, all(known) if known else None)
            elif rule == "first":
                setattr(self, f.name, mine or theirs)
            else:
                raise TypeError(f"GenerationMetrics.{f.name} has no merge rule")

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafted tokens / drafted tokens (0.0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """``1 + accepted / drafts`` as vLLM reports it (1.0 when nothing was drafted)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Share of rounds drafting position ``i`` in which it was accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)]

    @property
    def tokens_per_s(self) -> float:
        """New tokens / decode seconds (the first token comes from prefill but is counted)."""
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """All counters and derived rates, JSON-ready."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "drafts": self.drafts,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "acceptance_per_position": self.acceptance_per_position,
            "draft_lengths": list(self.draft_lengths),
            "leaves": self.leaves,
            "accepted_leaves": self.accepted_leaves,
            "drafter_forwards": self.drafter_forwards,
            "accepted_prediction_tokens": self.accepted_prediction_tokens,
            "rejected_prediction_tokens": self.rejected_prediction_tokens,
            "grammar_forced_tokens": self.grammar_forced_tokens,
            "grammar_spelled_tokens": self.grammar_spelled_tokens,
            "grammar_cut_tokens": self.grammar_cut_tokens,
            "grammar_mask_s": self.grammar_mask_s,
            "grammar_mask_us_per_token": 1e6 * self.grammar_mask_s / self.new_tokens if self.new_tokens else 0.0,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "calibration_s": self.calibration_s,
            "exact": self.exact,
            "exactness": self.exactness,
            "tokens_per_s": self.tokens_per_s,
        }

    def reference_mtp(self) -> dict[str, Any]:
        """The reference module's ``MtpMetrics`` fields, aggregated over the generation (mtp-semantics §4.6).

        There, a round's draft includes the target's own token ``x``: ``draft_tokens`` counts it in every
        drafted round and ``accepted_tokens`` counts it as accepted, so ``accepted_tokens_per_forward`` equals
        vLLM's mean acceptance length.
        """
        draft_tokens = self.drafted_tokens + self.drafts
        accepted = self.accepted_tokens + self.drafts
        return {
            "target_forwards": self.drafts,
            "mtp_forwards": self.drafter_forwards,
            "draft_tokens": draft_tokens,
            "accepted_tokens": accepted,
            "accepted_tokens_per_forward": accepted / self.drafts if self.drafts else 0.0,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        }

    def summary(self) -> str:
        """One human-readable line."""
        return (
            f"{self.new_tokens} tokens in {self.decode_s:.2f}s ({self.tokens_per_s:.1f} tok/s), "
            f"prefill {self.prompt_tokens} tokens"
            + (f" ({self.cached_prompt_tokens} cached)" if self.cached_prompt_tokens else "")
            + f" in {self.prefill_s:.2f}s, {self.target_forwards} target forwards, "
            f"acceptance {self.acceptance_rate:.1%} ({self.accepted_tokens}/{self.drafted_tokens}), "
            f"mean acceptance length {self.mean_acceptance_length:.2f}"
            + (f", {self.leaves} tree leaves ({self.accepted_leaves} accepted)" if self.leaves else "")
            + (
                f", prediction {self.accepted_prediction_tokens} accepted, {self.rejected_prediction_tokens} refused"
                if self.accepted_prediction_tokens or self.rejected_prediction_tokens
                else ""
            )
        )
