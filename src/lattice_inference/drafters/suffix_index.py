"""A bounded index over many token sequences (earlier requests' prompts and outputs, and the running one) that
finds where the current context's suffix occurred before and what followed it most often.

SuffixDecoding (Snowflake's Arctic Inference) keeps a suffix tree over earlier outputs; this is the same
question answered with a hash index, built for flat costs in pure Python:

* every position ``p`` of every held sequence is indexed under the hash of the ``L`` tokens ending at ``p``, for
  each anchor length ``L`` in `ANCHORS` (a short one, as prompt lookup's bigrams, and a long one, so that a long
  match in an old request is found even when its short anchor is common). An anchor keeps its `KEEP` most recent
  occurrences. Appending a token costs O(len(ANCHORS)).
* a lookup takes the longest anchor the context ends with that has occurrences, measures how far back each of them
  matches the context (up to `MAX_MATCH` tokens; the deepest suffix-tree node that holds the context's suffix),
  keeps the deepest ones and reads their continuations as a tree with counts: the draft follows the most frequent
  child at each depth (the most recent occurrence breaks ties) and the other children are its runners-up there.
  A lookup costs O(KEEP x (MAX_MATCH + depth)), whatever the index holds.
* the index holds at most ``budget`` tokens: appending past it evicts the oldest tokens first (whole earlier
  requests, oldest first; a running request longer than the budget loses its own oldest tokens), removing their
  anchors, so memory stays bounded (about 80 bytes per held token on CPython, see ``bench/bench_suffix.py``).

Hash collisions cannot mislead it: every occurrence is checked token by token. The output never depends on it
(the target decides every token); only how many forwards a generation takes.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from lattice_inference.options import check_budget

__all__ = ["ANCHORS", "KEEP", "MAX_MATCH", "SuffixIndex", "SuffixMatch", "common_suffix"]

ANCHORS = (2, 8)
"""Anchor lengths indexed at every position: the shortest match the index proposes from, and a long one."""
KEEP = 16
"""Most recent occurrences an anchor keeps: what bounds a lookup's work and the frequency counts it reads."""
MAX_MATCH = 32
"""How far back a match is measured: matches at least this long count as equally deep."""
RUNNERS_UP = 3
"""Other continuations kept per draft depth, most frequent first (candidate leaves of a draft tree)."""
_SHIFT = 32  # a position is (sequence id << _SHIFT) | offset


@dataclass
class SuffixMatch:
    """What the index proposes after a context: ``draft`` (the most frequent continuation, token by token),
    ``runners_up[j]`` (the other tokens seen at depth ``j`` after ``draft[:j]``, most frequent first), ``depth``
    (how many context tokens matched, up to `MAX_MATCH`) and ``support`` (how many occurrences agree on the first
    draft token)."""

    draft: list[int] = field(default_factory=list)
    runners_up: list[list[int]] = field(default_factory=list)
    depth: int = 0
    support: int = 0


@dataclass
class _Sequence:
    tokens: array
    start: int = 0
    """Offset of the oldest token still indexed (earlier ones were evicted)."""


class SuffixIndex:
    """Token sequences (requests' prompts followed by their outputs) held under a token ``budget``, searchable
    by the context's suffix. `begin` starts a sequence (a request), `append` extends the newest one as tokens
    are accepted, `match` proposes a continuation, `clear` forgets everything.

    One index is one scope: everything in it may draft for everything else in it. A server keeps one per tenant.
    """

    def __init__(self, budget: int) -> None:
        check_budget(budget)
        self.budget = budget
        self._sequences: OrderedDict[int, _Sequence] = OrderedDict()
        self._maps: list[dict[int, int | list[int]]] = [{} for _ in ANCHORS]
        self._held = 0
        self._next_id = 0
        self.examined = 0
        """Occurrences the latest `match` compared with the context (a measure of its work)."""

    def __len__(self) -> int:
        """Tokens held (indexed), never more than ``budget``."""
        return self._held

    @property
    def sequences(self) -> int:
        """How many sequences hold at least one token."""
        return len(self._sequences)

    @property
    def anchors(self) -> int:
        """Distinct anchors indexed, over every anchor length (what most of the memory goes to)."""
        return sum(len(m) for m in self._maps)

    def clear(self) -> None:
        """Forget every sequence (a tenant's "clear my index")."""
        self._sequences.clear()
        self._maps = [{} for _ in ANCHORS]
        self._held = 0

    def begin(self, tokens: Iterable[int] = ()) -> int:
        """Start a new sequence (a request) with ``tokens`` (its prompt); returns its id for `append`."""
        seq_id = self._next_id
        self._next_id += 1
        self._sequences[seq_id] = _Sequence(array("q"))
        self.append(seq_id, tokens)
        return seq_id

    def append(self, seq_id: int, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` and index them, evicting the oldest tokens past the budget
        (appending to a sequence that was evicted whole does nothing)."""
        seq = self._sequences.get(seq_id)
        if seq is None:
            return
        data = seq.tokens
        base = seq_id << _SHIFT
        for tok in tokens:
            data.append(tok)
            end = len(data) - 1
            for anchor, index in zip(ANCHORS, self._maps, strict=True):
                if end + 1 >= anchor:
                    _add(index, hash(tuple(data[end - anchor + 1 : end + 1])), base | end)
            self._held += 1
            if self._held > self.budget:
                self._evict_one()

    def _evict_one(self) -> None:
        """Un-index the oldest held token (dropping its sequence when none of it is left and a newer one is)."""
        seq_id, seq = next(iter(self._sequences.items()))
        while seq.start == len(seq.tokens):  # nothing of it held (begun empty): drop it
            del self._sequences[seq_id]
            seq_id, seq = next(iter(self._sequences.items()))
        data, p = seq.tokens, seq.start
        for anchor, index in zip(ANCHORS, self._maps, strict=True):
            if p + 1 >= anchor:
                _remove(index, hash(tuple(data[p - anchor + 1 : p + 1])), (seq_id << _SHIFT) | p)
        seq.start += 1
        self._held -= 1
        if seq.start == len(data) and len(self._sequences) > 1:
            del self._sequences[seq_id]

    def match(self, context: Sequence[int], max_tokens: int, stop: frozenset[int] = frozenset()) -> SuffixMatch:
        """The continuation most often seen after the longest suffix of ``context`` found in the index (its last
        `MAX_MATCH` tokens are enough), at most ``max_tokens`` long and cut before any ``stop`` token (EOS must
        come from the target). Occurrences without a continuation (the running sequence's last token) do not
        count. Empty when nothing matches at least the shortest anchor."""
        self.examined = 0
        found: list[tuple[int, array, int]] = []  # (match depth, tokens, continuation start)
        for anchor, index in zip(reversed(ANCHORS), reversed(self._maps), strict=True):
            if len(context) < anchor or max_tokens < 1:
                continue
            hit = index.get(hash(tuple(context[-anchor:])))
            if hit is None:
                continue
            for pos in (hit,) if isinstance(hit, int) else reversed(hit):
                self.examined += 1
                data = self._sequences[pos >> _SHIFT].tokens
                end = pos & ((1 << _SHIFT) - 1)
                if end + 1 >= len(data):
                    continue
                depth = common_suffix(data, end, context)
                if depth >= anchor:
                    found.append((depth, data, end + 1))
            if found:
                break
        if not found:
            return SuffixMatch()
        deepest = max(d for d, _, _ in found)
        chosen = [(data, start) for d, data, start in found if d == deepest]
        return _continuation(chosen, max_tokens, stop, deepest)


def _add(index: dict[int, int | list[int]], key: int, pos: int) -> None:
    hit = index.get(key)
    if hit is None:
        index[key] = pos
    elif isinstance(hit, int):
        index[key] = [hit, pos]
    else:
        hit.append(pos)
        if len(hit) > KEEP:
            del hit[0]


def _remove(index: dict[int, int | list[int]], key: int, pos: int) -> None:
    """Remove ``pos``, the oldest occurrence of ``key`` if it is still kept."""
    hit = index.get(key)
    if hit == pos:
        del index[key]
    elif isinstance(hit, list) and hit[0] == pos:
        del hit[0]
        if len(hit) == 1:
            index[key] = hit[0]


def common_suffix(data: Sequence[int], end: int, context: Sequence[int]) -> int:
    """How many tokens ending at ``data[end]`` equal the last ones of ``context`` (at most `MAX_MATCH`): the depth
    of a match, measured alike for the index's occurrences and a prompt-lookup one."""
    limit = min(MAX_MATCH, end + 1, len(context))
    n = 0
    while n < limit and data[end - n] == context[-1 - n]:
        n += 1
    return n


def _continuation(chosen: list[tuple[array, int]], max_tokens: int, stop: frozenset[int], depth: int) -> SuffixMatch:
    """Read the continuations of the ``chosen`` occurrences (most recent first) as a tree with counts: the draft
    takes the most frequent child at each depth (ties: the most recent), the rest are its runners-up."""
    out = SuffixMatch(depth=depth)
    live = chosen
    for d in range(max_tokens):
        counts: dict[int, int] = {}
        for data, start in live:
            if start + d < len(data):
                tok = data[start + d]
                counts[tok] = counts.get(tok, 0) + 1
        if not counts:
            break
        ranked = sorted(counts, key=counts.__getitem__, reverse=True)  # stable: recency breaks ties
        best = ranked[0]
        if best in stop:
            break
        if d == 0:
            out.support = counts[best]
        out.draft.append(best)
        out.runners_up.append([t for t in ranked[1:] if t not in stop][:RUNNERS_UP])
        live = [(data, start) for data, start in live if start + d < len(data) and data[start + d] == best]
    return out
