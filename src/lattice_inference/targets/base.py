"""The target protocol: the model being accelerated.

A target owns the model's cache and the position of the next write. ``forward`` feeds tokens at explicit,
contiguous positions starting at ``length`` and returns logits for every one of them; ``rollback`` moves the
write position back so that rejected draft tokens leave no trace. Positions are never implicit: the token at
index ``i`` of the sequence is always fed at position ``i``.

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
    """One sequence's state on a target (its cache, its length, the ids of its rows, whose rows they are), held
    here while another sequence is the target's current one. A `Generation` that shares a target with others owns
    one (`Target.new_sequence`); `Target.use` makes it current, so the target's single-sequence methods (`prefill`,
    `forward`, `rollback`, ...) act on it."""

    def __init__(self, target: object, state: dict[str, object]) -> None:
        self.target = target
        self.state = state
        """The saved attributes (`Target.sequence_fields`) while not current; empty while current."""
        self.released = False


@dataclass(frozen=True)
class Segment:
    """One sequence's rows in a batched forward (`Target.forward_batch`): its next token and draft (a chain), or a
    draft tree where ``parents`` is given (as `Target.forward_tree` takes it)."""

    sequence: TargetSequence
    tokens: Sequence[int]
    parents: Sequence[int] | None = None


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
    """Whether setting ``capture_hidden = True`` fills `last_hidden` (MTP drafting needs it)."""

    capture_hidden: bool = False
    """When true (and ``provides_hidden_states``), every `prefill`/`forward` keeps the post-final-norm hidden
    states of all fed positions in `last_hidden` (``[n, hidden]``)."""

    last_hidden: torch.Tensor | None = None

    fuses_prefill_and_draft: bool = False
    """Whether `prefill_with_draft` is offered (where rolling back into a prefill is cheap)."""

    verifies_trees: bool = False
    """Whether `forward_tree` is offered, and `keep_rows` keeps any path of it (attention caches whose rows can be
    moved; not recurrent state)."""

    decode_matched: bool = False
    """Whether every row of a `forward` (or `forward_tree`) of several tokens is meant to equal, bitwise, the
    1-token `forward` at that position (`lattice_inference.targets.exactness` checks it before the first drafted
    generation), so that verification is lossless in any dtype."""

    prefix_reused: int = 0
    """How many leading rows of the last `prefill` came from the cache as it stood (the earlier sequence's rows
    for the same tokens) instead of being computed: only where they equal bit for bit what a fresh prefill would
    compute (`lattice_inference.targets.prefix_reuse`); 0 for targets that never reuse."""

    prefix_owner: str | None = ""
    """Whose earlier sequences a `prefill` may reuse rows of: only those prefilled under the same owner (``lattice
    serve`` sets each request's tenant); None: reuse none, and keep none of this one's for later."""

    sequence_fields: tuple[str, ...] = ()
    """The attributes that hold the current sequence's state, which `use` saves and restores (empty: the target
    holds one sequence only, and `new_sequence` is refused)."""

    batches_sequences: bool = False
    """Whether `forward_batch` computes the rows of several sequences in one forward, each row bit for bit what the
    sequence's forward alone computes (else a batch runs its sequences' forwards one after the other)."""

    def _fresh_sequence(self) -> dict[str, object]:
        """The `sequence_fields` of an empty sequence (subclasses add theirs)."""
        return {}

    def new_sequence(self, owner: str | None = "") -> TargetSequence:
        """A new, empty sequence on this target (current once `use`d; its first call is `prefill`). ``owner``:
        whose earlier sequences its prefill may reuse rows of (`prefix_owner`)."""
        if not self.sequence_fields:
            raise NotImplementedError(f"{type(self).__name__} holds one sequence only")
        return TargetSequence(self, {**self._fresh_sequence(), "prefix_owner": owner})

    @property
    def default_sequence(self) -> TargetSequence:
        """The sequence a target starts with, which single generations (`SpeculativeDecoder.start`) run on."""
        default = self.__dict__.get("_default_sequence")
        if default is None:
            default = self.__dict__["_default_sequence"] = TargetSequence(self, {})
            self.__dict__.setdefault("_current_sequence", default)
        return default

    @property
    def current_sequence(self) -> TargetSequence:
        """The sequence the single-sequence methods act on now."""
        default = self.default_sequence
        current = self.__dict__.get("_current_sequence", default)
        assert isinstance(current, TargetSequence)
        return current

    def use(self, sequence: TargetSequence) -> None:
        """Make ``sequence`` the current one: the current one's state is saved in its `TargetSequence`, and
        ``sequence``'s restored (a few attribute assignments; no tensor is copied)."""
        current = self.current_sequence
        if sequence is current:
            return
        if sequence.target is not self or sequence.released:
            raise ValueError("this sequence belongs to another target, or was released")
        current.state = {name: getattr(self, name) for name in self.sequence_fields}
        for name, value in sequence.state.items():
            setattr(self, name, value)
        sequence.state = {}
        self.__dict__["_current_sequence"] = sequence

    def release(self, sequence: TargetSequence) -> None:
        """Done with ``sequence`` (its generation ended): the default sequence becomes current if it was, and its
        cache is dropped, or kept for later prefills to reuse where the target does (`_retire`)."""
        if sequence.released or sequence is self.default_sequence:
            return
        self.use(sequence)
        self._retire()
        self.use(self.default_sequence)
        sequence.state, sequence.released = {}, True

    def _retire(self) -> None:
        """The current sequence ends (`release`): keep what a later prefill may reuse (the default keeps none)."""

    def forward_batch(self, segments: Sequence[Segment]) -> list[SegmentOutput]:
        """Feed each segment's rows after its sequence's cache (as `forward`, or `forward_tree` with ``parents``),
        all in one forward, every row bit for bit what its sequence's own forward computes. Only where
        ``batches_sequences``; afterwards the current sequence is the last segment's."""
        raise NotImplementedError(f"{type(self).__name__} does not batch sequences")

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

    @property
    def length(self) -> int:
        """Number of tokens in the cache; the next token fed goes to this position."""
        ...

    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Reset the cache, feed ``token_ids`` at positions ``0..n-1`` and return the last position's logits
        as a float tensor of shape ``[vocab]``."""
        ...

    def prefill_with_draft(self, token_ids: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        """Prefill ``token_ids`` and feed ``draft`` after them in one forward: logits ``[len(draft) + 1, vocab]``
        for the last prompt position and every draft position; the caller rolls back to
        ``len(token_ids) + accepted``. Only where ``fuses_prefill_and_draft``."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse prefill and draft")

    def forward(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Feed ``token_ids`` at positions ``length..length+k-1`` and return logits ``[k, vocab]``."""
        ...

    def rollback(self, length: int) -> None:
        """Discard every cached token at position ``>= length`` (``0 <= length <= self.length``)."""
        ...

    def forward_tree(self, token_ids: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Feed a draft tree after the cache: row ``i`` holds ``token_ids[i]`` at position ``length + depth(i)``
        and attends to the cache and its ancestors only (``parents[i]``, the earlier row it follows; -1 for row 0,
        the only root). Returns logits ``[n, vocab]``; `keep_rows` must follow. Only where ``verifies_trees``."""
        raise NotImplementedError(f"{type(self).__name__} does not verify draft trees")

    def forget_prefix(self, owner: str | None = None) -> None:
        """Make later prefills compute every row instead of reusing those of the sequences cached so far (every
        owner's, or only ``owner``'s). A no-op where nothing is reused."""

    def keep_rows(self, start: int, rows: Sequence[int]) -> None:
        """After a forward (or `forward_tree`) that fed rows at ``start``, keep the rows ``rows`` (increasing,
        a path from row 0) as positions ``start ..`` and drop the rest. A prefix of the fed rows is a rollback,
        which every target does; other paths only where ``verifies_trees``."""
        if list(rows) != list(range(len(rows))):
            raise NotImplementedError(f"{type(self).__name__} keeps only a prefix of the rows it fed, got {list(rows)}")
        self.rollback(start + len(rows))
