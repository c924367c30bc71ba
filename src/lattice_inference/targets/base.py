"""The target protocol: the model being accelerated.

A target is a runner over explicit sequences: it holds the weights, its buffers and measured facts, and each
request's state lives in a `TargetSequence` the request owns (its cache, its length, what its last forward
produced), passed to every call. ``forward(seq, ids)`` feeds tokens at explicit, contiguous positions starting at
``seq.length`` and returns logits for every one of them; ``rollback(seq, n)`` moves the write position back so
that rejected draft tokens leave no trace. Positions are never implicit: the token at index ``i`` of the sequence
is always fed at position ``i``.

Subclass `Target` to inherit the defaults of its optional parts (no hidden-state capture, no fused
prefill+draft); the decode loop reads them directly, never by probing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from lattice_inference.targets.facts import TargetFacts


class TargetSequence:
    """One sequence on a target: its cache slot and everything a forward of it produced. A `Generation` owns one
    (`Target.new_sequence`) and passes it to every call of the target (`prefill`, `forward`, `rollback`, ...), so
    the target holds no request's state: only weights, buffers and measured facts. Targets with more to keep per
    sequence (the ids of its cached rows, a recurrent model's rollback window) subclass it."""

    def __init__(
        self, target: Target, owner: str | None = "", *, capture_hidden: bool = False, probe: bool = False
    ) -> None:
        self.target = target
        self.owner = owner
        self.probe = probe
        """Whether it is one of the target's own measurements (the self-check, forward costs), not a request's: it
        never holds a preallocated cache slot (`kv_slots`), so measuring never waits for or evicts a request's."""
        """Whose earlier sequences its prefill may reuse rows of, and who may reuse its rows once released: only
        sequences of the same owner (``lattice serve`` gives each tenant's requests its tenant); None: it reuses
        none, and none of its rows are kept for later."""
        self.capture_hidden = capture_hidden
        """Whether its forwards keep the post-final-norm hidden states of their rows in `hidden` (an MTP drafter
        reads them; only where the target ``provides_hidden_states``)."""
        self.cache: object = None
        """The target's cache of this sequence (its own type; None before the first `prefill`)."""
        self.length = 0
        """Tokens in the cache: the next token fed goes to this position."""
        self.reused = 0
        """How many leading rows of its last `prefill` came from a cache as it stood instead of being computed
        (only where bit for bit what a fresh prefill computes: `lattice_inference.targets.prefix_reuse`)."""
        self.hidden: torch.Tensor | None = None
        """The hidden states ``[rows, hidden]`` of its last forward's rows, where ``capture_hidden``; else None."""
        self.released = False


@dataclass(frozen=True)
class Segment:
    """One sequence's rows in a batched forward (`Target.forward_batch`): its next token and draft (a chain), a
    draft tree where ``parents`` is given (as `Target.forward_tree` takes it), or a chunk of its prompt (after
    `Target.open_prompt`). ``logits``: how many of its last rows' logits are wanted (0: every row's; a prompt's
    chunk wants its last row's at most, and the vocabulary product of the rest is skipped)."""

    sequence: TargetSequence
    tokens: Sequence[int]
    parents: Sequence[int] | None = None
    logits: int = 0


@dataclass(frozen=True)
class SegmentOutput:
    """What a batched forward gives one sequence: logits ``[rows, vocab]`` and, where ``capture_hidden``, the
    hidden states of its rows (else None)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None


@runtime_checkable
class Target(Protocol):
    """A causal LM that can score several tokens in one forward and roll its cache back."""

    provides_hidden_states: bool = False
    """Whether a sequence made with ``capture_hidden=True`` gets its rows' hidden states (`TargetSequence.hidden`;
    MTP drafting needs them)."""

    fuses_prefill_and_draft: bool = False
    """Whether `prefill_with_draft` is offered (where rolling back into a prefill is cheap)."""

    verifies_trees: bool = False
    """Whether `forward_tree` is offered, and `keep_rows` keeps any path of it (attention caches whose rows can be
    moved; not recurrent state)."""

    decode_matched: bool = False
    """Whether every row of a `forward` (or `forward_tree`) of several tokens is meant to equal, bitwise, the
    1-token `forward` at that position (`lattice_inference.targets.exactness` checks it before the first drafted
    generation), so that verification is lossless in any dtype."""

    kv_slots: int = 0
    """How many sequences' caches are preallocated (each sequence holds one slot while it lives or is kept); 0: each
    cache grows as it needs, no limit."""

    batches_sequences: bool = False
    """Whether `forward_batch` computes the rows of several sequences in one forward, each row bit for bit what the
    sequence's forward alone computes (else a batch runs its sequences' forwards one after the other)."""

    def new_sequence(
        self, owner: str | None = "", *, capture_hidden: bool = False, probe: bool = False
    ) -> TargetSequence:
        """A new, empty sequence on this target (its first call is `prefill`). ``owner``: whose earlier sequences
        its prefill may reuse rows of (`TargetSequence.owner`); ``capture_hidden``: keep its rows' hidden states;
        ``probe``: one of the target's own measurements (`TargetSequence.probe`)."""
        if capture_hidden and not self.provides_hidden_states:
            raise ValueError(f"{type(self).__name__} does not provide hidden states")
        return TargetSequence(self, owner, capture_hidden=capture_hidden, probe=probe)

    def release(self, sequence: TargetSequence) -> None:
        """Done with ``sequence`` (its generation ended): its cache is dropped, or kept for later prefills of the same
        owner to reuse where the target does (`_retire`). Releasing twice does nothing."""
        if sequence.released:
            return
        self._own(sequence)
        self._retire(sequence)
        sequence.cache, sequence.hidden, sequence.released = None, None, True

    def _retire(self, sequence: TargetSequence) -> None:
        """``sequence`` ends (`release`): keep what a later prefill may reuse (the default keeps none)."""

    def _own(self, sequence: TargetSequence) -> None:
        """Refuse a sequence of another target, or one already released."""
        if sequence.target is not self:
            raise ValueError("this sequence belongs to another target")
        if sequence.released:
            raise ValueError("this sequence was released")

    def forward_batch(self, segments: Sequence[Segment]) -> list[SegmentOutput]:
        """Feed each segment's rows after its sequence's cache (as `forward`, or `forward_tree` with ``parents``):
        where ``batches_sequences``, all in one forward, every row bit for bit what its sequence's own forward
        computes; else (this default) each sequence's forward in turn."""
        outputs = []
        for segment in segments:
            seq, tokens = segment.sequence, segment.tokens
            if segment.parents is None:
                logits = self.forward(seq, tokens)
            else:
                logits = self.forward_tree(seq, tokens, segment.parents)
            outputs.append(SegmentOutput(logits[-segment.logits :] if segment.logits else logits, seq.hidden))
        return outputs

    def open_prompt(self, sequence: TargetSequence, token_ids: Sequence[int]) -> int | None:
        """Make ``sequence`` ready to take ``token_ids`` in by forwards (chunks of the prompt, which may share a
        batched forward with other sequences' rounds) whose rows equal bit for bit those its `prefill` computes:
        its cache set up holding the prompt's longest reusable prefix; returns how many rows that is (the rest are
        to be fed in order). None (this default) where this target's forwards do not compute a prompt's rows as
        its prefill does: the prompt is then prefilled whole, and ``sequence`` is left as it was."""
        return None

    @property
    def kv_cache(self) -> str:
        """How the cache stores keys and values where not in the model's dtype (``"float16"``: `options.KV_CACHES`),
        else empty (the default)."""
        return ""

    @property
    def facts(self) -> TargetFacts:
        """This target's `TargetFacts`, made on first use (so subclasses need not call an ``__init__`` for it)."""
        facts = self.__dict__.get("_facts")
        if facts is None:
            facts = self.__dict__["_facts"] = TargetFacts()
        return facts

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model accepts as input."""
        ...

    @property
    def max_positions(self) -> int | None:
        """Largest sequence length the model supports, or ``None`` when unbounded or unknown."""
        ...

    def prefill(self, sequence: TargetSequence, token_ids: Sequence[int]) -> torch.Tensor:
        """Reset ``sequence``'s cache, feed ``token_ids`` at positions ``0..n-1`` and return the last position's logits
        as a float tensor of shape ``[vocab]``."""
        ...

    def prefill_with_draft(
        self, sequence: TargetSequence, token_ids: Sequence[int], draft: Sequence[int]
    ) -> torch.Tensor:
        """Prefill ``token_ids`` and feed ``draft`` after them in one forward: logits ``[len(draft) + 1, vocab]``
        for the last prompt position and every draft position; the caller rolls back to
        ``len(token_ids) + accepted``. Only where ``fuses_prefill_and_draft``."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse prefill and draft")

    def forward(self, sequence: TargetSequence, token_ids: Sequence[int]) -> torch.Tensor:
        """Feed ``token_ids`` after ``sequence``'s cache, at positions ``length..length+k-1``, and return logits
        ``[k, vocab]``."""
        ...

    def rollback(self, sequence: TargetSequence, length: int) -> None:
        """Discard every cached token of ``sequence`` at position ``>= length`` (``0 <= length <= sequence.length``)."""
        ...

    def forward_tree(self, sequence: TargetSequence, token_ids: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Feed a draft tree after ``sequence``'s cache: row ``i`` holds ``token_ids[i]`` at position
        ``length + depth(i)`` and attends to the cache and its ancestors only (``parents[i]``, the earlier row it
        follows; -1 for row 0, the only root). Returns logits ``[n, vocab]``; `keep_rows` must follow. Only where
        ``verifies_trees``."""
        raise NotImplementedError(f"{type(self).__name__} does not verify draft trees")

    def forget_prefix(self, owner: str | None = None) -> None:
        """Make later prefills compute every row instead of reusing those of the sequences cached so far (every
        owner's, or only ``owner``'s). A no-op where nothing is reused."""

    def keep_rows(self, sequence: TargetSequence, start: int, rows: Sequence[int]) -> None:
        """After ``sequence``'s forward (or `forward_tree`) that fed rows at ``start``, keep the rows ``rows``
        (increasing, a path from row 0) as positions ``start ..`` and drop the rest. A prefix of the fed rows is a
        rollback, which every target does; other paths only where ``verifies_trees``."""
        if list(rows) != list(range(len(rows))):
            raise NotImplementedError(f"{type(self).__name__} keeps only a prefix of the rows it fed, got {list(rows)}")
        self.rollback(sequence, start + len(rows))
