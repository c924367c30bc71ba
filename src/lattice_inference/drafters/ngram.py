"""N-gram (prompt lookup) drafting with an incremental hash index.

The drafter looks for an earlier occurrence of the history's last ``n`` tokens (``n`` from ``max_ngram`` down
to ``min_ngram``) and proposes the tokens that followed it, like vLLM's ``NgramProposer`` and Hugging Face's
``PromptLookupCandidateGenerator``. The history is the prompt followed by every accepted token.

Instead of scanning the history on every proposal (O(history) per step, as the reference and HF do), the
drafter keeps one dict per n-gram length mapping each n-gram to the position of its first (or most recent)
occurrence. Indexing costs O(max_ngram) per appended token and a proposal costs O(max_ngram + max_draft),
independent of the history length.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, overload

from lattice_inference.drafters.base import Drafter, DrafterState, Proposal, Spelling
from lattice_inference.errors import ConfigError, TokenError
from lattice_inference.options import (
    GRAMMAR_MIN_NGRAM,
    DecodeOptions,
    MatchPolicy,
    check_match,
    check_ngram_range,
    check_positive,
)

if TYPE_CHECKING:
    from lattice_inference.drafters.suffix_index import SuffixIndex
    from lattice_inference.sampling import Sampler

TEXT_MATCH = 24
"""Longest suffix of the history's text (bytes) `NgramState._spelled_lookup` looks for."""
MIN_TEXT_MATCH = 2
"""Shortest: fewer bytes than this match almost anywhere."""
TEXT_AHEAD = 6
"""Bytes of text taken per token wanted after a text match (English runs about 4 bytes a token)."""
SPELLED_KEY = 0
"""The planner key of a draft from the text (`NgramState._spelled_lookup`): no n-gram of tokens matched."""

__all__ = ["MatchPolicy", "NgramDrafter", "NgramIndex", "NgramState", "TokenView", "validate_token_ids"]


def validate_token_ids(token_ids: Iterable[int], what: str = "token ids") -> list[int]:
    """Return ``token_ids`` as a list of Python ints, or raise :class:`TokenError`.

    Accepts anything that iterates to integers (ints, numpy integers, 0-d integer tensors). Bools, floats and
    negative values are rejected; the error names the offending value and its index.
    """
    out: list[int] = []
    for i, tok in enumerate(token_ids):
        if isinstance(tok, bool):
            raise TokenError(f"{what}: element {i} is a bool ({tok!r}); expected a non-negative int")
        try:
            value = operator.index(tok)
        except TypeError:
            raise TokenError(
                f"{what}: element {i} is {tok!r} of type {type(tok).__name__}; expected a non-negative int"
            ) from None
        if value < 0:
            raise TokenError(f"{what}: element {i} is {value}; token ids must be non-negative")
        out.append(value)
    return out


def _check_lengths(min_ngram: int, max_ngram: int) -> None:
    """The index's own invariant, for callers that build one directly: the range `DecodeOptions` checks for every
    front-end (`check_ngram_range`)."""
    check_ngram_range(min_ngram, max_ngram)


class TokenView(Sequence[int]):
    """A read-only, zero-copy view of a token list owned by an index or drafter."""

    __slots__ = ("_tokens",)

    def __init__(self, tokens: list[int]) -> None:
        self._tokens = tokens

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._tokens[index]

    def __len__(self) -> int:
        return len(self._tokens)

    def __iter__(self) -> Iterator[int]:
        return iter(self._tokens)

    def __repr__(self) -> str:
        return f"TokenView(len={len(self._tokens)})"


class NgramIndex:
    """Incremental index of the n-grams of a growing token list.

    For every ``n`` in ``[min_ngram, max_ngram]`` it maps each n-gram (as a tuple) to the position of its
    **last** token in its first (``keep="first"``, leftmost) or most recent (``keep="recent"``) occurrence.
    :meth:`extend` costs O(max_ngram) per appended token; :meth:`lookup` costs O(n).

    Args:
        min_ngram: shortest indexed n-gram length (>= 1).
        max_ngram: longest indexed n-gram length (>= min_ngram).
        keep: ``"first"`` to keep the leftmost occurrence, ``"recent"`` to keep the latest one.
    """

    __slots__ = ("_maps", "_tokens", "keep", "max_ngram", "min_ngram")

    def __init__(self, min_ngram: int = 1, max_ngram: int = 5, keep: MatchPolicy = "first") -> None:
        _check_lengths(min_ngram, max_ngram)
        check_match(keep)
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.keep: MatchPolicy = keep
        self._tokens: list[int] = []
        # _maps[n] is the dict for n-grams of length n (entries below min_ngram are unused).
        self._maps: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]

    def __len__(self) -> int:
        """Number of indexed tokens."""
        return len(self._tokens)

    @property
    def tokens(self) -> TokenView:
        """The indexed tokens (read-only view)."""
        return TokenView(self._tokens)

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append ``token_ids`` and index every n-gram that ends at one of them.

        Raises:
            TokenError: a token id is negative or not an integer (nothing is appended then).
        """
        self._extend_trusted(validate_token_ids(token_ids))

    def _extend_trusted(self, token_ids: list[int]) -> None:
        """:meth:`extend` for a list already validated by :func:`validate_token_ids`."""
        tokens = self._tokens
        maps = self._maps
        lo, hi = self.min_ngram, self.max_ngram
        first = self.keep == "first"
        for tok in token_ids:
            tokens.append(tok)
            end = len(tokens) - 1
            top = min(hi, end + 1)
            for n in range(lo, top + 1):
                key = tuple(tokens[end - n + 1 :])
                if first:
                    maps[n].setdefault(key, end)
                else:
                    maps[n][key] = end

    def lookup(self, pattern: Sequence[int]) -> int | None:
        """Return the end position (index of the last token) of the kept occurrence of ``pattern``, or None.

        Raises:
            ConfigError: ``len(pattern)`` lies outside ``[min_ngram, max_ngram]``.
        """
        n = len(pattern)
        if not self.min_ngram <= n <= self.max_ngram:
            raise ConfigError(f"pattern length {n} is outside the indexed range [{self.min_ngram}, {self.max_ngram}]")
        return self._maps[n].get(tuple(pattern))


class NgramDrafter(Drafter):
    """Prompt-lookup drafter over the whole history (prompt and accepted output); implements ``Drafter``.

    For ``n`` from ``max_ngram`` down to ``min_ngram`` (1 under a grammar: `NgramState.under_grammar`; clamped to the
    history length), the last ``n`` history tokens are looked up among the occurrences that end before the last history
    position (so the trailing self-match never counts). The first ``n`` with a match wins and the tokens that followed
    that occurrence are proposed, at most ``min(max_draft, max_tokens)`` of them, cut before the first EOS token (EOS
    must only ever come from the target model). Each generation's history and index live in its `NgramState`.

    Args:
        max_ngram: longest suffix length tried (>= 1).
        min_ngram: shortest suffix length tried (>= 1, <= max_ngram).
        max_draft: most tokens proposed per call (>= 1).
        match: ``"first"`` uses the leftmost earlier occurrence (reference, vLLM and HF behaviour; it also has
            the longest continuation); ``"recent"`` uses the most recent earlier occurrence.
        eos_token_ids: token ids that end a draft (excluded from it).

    Cost: ``extend`` is O(1) per token (indexing is deferred to ``propose``, O(max_ngram) per new token);
    ``propose`` is O(max_ngram + max_draft) beyond that, independent of the history length.
    """

    def __init__(
        self,
        max_ngram: int = DecodeOptions.max_ngram,
        min_ngram: int = DecodeOptions.min_ngram,
        max_draft: int = DecodeOptions.max_draft,
        match: MatchPolicy = DecodeOptions.match,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        _check_lengths(min_ngram, max_ngram)
        check_positive("max_draft", max_draft)
        check_match(match)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_draft = max_draft
        self.match: MatchPolicy = match
        self.eos_token_ids: frozenset[int] = frozenset(validate_token_ids(eos_token_ids, "eos_token_ids"))

    def new_state(
        self, prompt_ids: Sequence[int], sampler: Sampler | None = None, suffix_index: SuffixIndex | None = None
    ) -> NgramState:
        """A generation over ``prompt_ids``.

        Raises:
            TokenError: a token id is negative or not an integer.
        """
        return NgramState(self, validate_token_ids(prompt_ids, "prompt_ids"))


class NgramState(DrafterState):
    """One generation's n-gram lookup: its history and the incremental index over it (the settings are the
    drafter's, read at each proposal)."""

    def __init__(self, drafter: NgramDrafter, prompt: list[int]) -> None:
        self.drafter = drafter
        self._history = prompt
        self.min_ngram = drafter.min_ngram
        """The shortest n-gram this generation looks up (the drafter's; `GRAMMAR_MIN_NGRAM` under a grammar)."""
        # Invariant after _catch_up(): the index holds history[:-1], i.e. only n-grams ending at positions
        # <= len(history) - 2, so every match found has at least one continuation token.
        self._index = self._new_index()
        self._spelling: Spelling | None = None
        self._text = bytearray()  # what history[: self._spelled] spells (with a spelling only)
        self._spelled = 0

    def _new_index(self) -> NgramIndex:
        """An empty index of this generation's n-grams (``min_ngram`` up to the drafter's ``max_ngram``)."""
        return NgramIndex(self.min_ngram, self.drafter.max_ngram, keep=self.drafter.match)

    def under_grammar(self, spelling: Spelling | None = None) -> None:
        """Look up n-grams down to `GRAMMAR_MIN_NGRAM` tokens (a grammar's fixed spans repeat token for token: ``":``
        then ``"`` before every string value), and with ``spelling`` the text where no n-gram matches
        (`_spelled_lookup`). Before the first proposal only (the index is built lazily then)."""
        if len(self._index) == 0 and GRAMMAR_MIN_NGRAM < self.min_ngram:
            self.min_ngram = GRAMMAR_MIN_NGRAM
            self._index = self._new_index()
        self._spelling = spelling

    def _spelled_lookup(self, k: int) -> list[int]:
        """Up to ``k`` tokens from the text: the history's text is searched for the longest of its own last
        `TEXT_MATCH` bytes (at least the last token's, and `MIN_TEXT_MATCH`) that occurred before, and the text
        after that occurrence is spelled in tokens (its last token left out unless the text ends there: the bytes
        after the cut could merge into it). A value copied into JSON begins with other tokens than the prompt's
        words (``"Mad`` then ``rid`` where the prompt spells `` Madrid``), so no n-gram of tokens matches there
        while the text does. Where no suffix occurred before, a string's first word (after the last ``"``) is
        looked for as a word of the text (after a space): ``"P`` as `` P``."""
        spelling = self._spelling
        assert spelling is not None
        history = self._history
        if self._spelled < len(history):  # the text of the tokens appended since the last lookup
            self._text += spelling.decode_bytes(history[self._spelled :])
            self._spelled = len(history)
        text = self._text
        last = len(spelling.decode_bytes(history[-1:]))
        start = -1
        for size in range(min(TEXT_MATCH, len(text) - 1), max(last, MIN_TEXT_MATCH) - 1, -1):
            at = text.find(text[-size:])
            if at + size < len(text):  # an occurrence before the text's own end
                start = at + size
                break
        quote = text.rfind(b'"')
        word = text[quote + 1 :]
        if start < 0 and quote >= 0 and 0 < len(word) <= TEXT_MATCH and len(word) + 1 >= last and b" " not in word:
            at = text.find(b" " + word, 0, quote)  # a string's first word, as the prompt spells a word: after a space
            start = at + 1 + len(word) if at >= 0 else -1
        if start < 0:
            return []
        stop = start + TEXT_AHEAD * k
        tokens = spelling.tokenize_bytes(bytes(text[start:stop]))
        if stop < len(text):
            tokens = tokens[:-1]
        return [int(t) for t in tokens[:k]]

    @property
    def history(self) -> TokenView:
        """The token history: prompt followed by accepted tokens (read-only view)."""
        return TokenView(self._history)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append accepted tokens to the history.

        Raises:
            TokenError: a token id is negative or not an integer (nothing is appended then).
        """
        self._history.extend(validate_token_ids(token_ids))

    def _catch_up(self) -> None:
        target = len(self._history) - 1
        done = len(self._index)
        if done < target:
            self._index._extend_trusted(self._history[done:target])

    def propose(self, max_tokens: int) -> Proposal:
        """Return up to ``min(max_draft, max_tokens)`` tokens likely to follow the history (possibly none), keyed
        by the matched n-gram's length.

        ``max_tokens <= 0`` returns an empty list.
        """
        return self.lookup(max_tokens)[0]

    def lookup(self, max_tokens: int) -> tuple[Proposal, int]:
        """`propose`'s proposal and the history position of the last token of the occurrence it copies from (-1
        where nothing matched), so that a caller can measure how deep that occurrence matches the history."""
        drafter = self.drafter
        k = min(drafter.max_draft, max_tokens)
        history = self._history
        size = len(history)
        if k <= 0 or size < 2:
            return Proposal(), -1
        self._catch_up()
        maps = self._index._maps
        for n in range(min(drafter.max_ngram, size - 1), self.min_ngram - 1, -1):
            end = maps[n].get(tuple(history[size - n :]))
            if end is not None:
                draft = history[end + 1 : end + 1 + k]
                eos = drafter.eos_token_ids
                if eos:
                    for i, tok in enumerate(draft):
                        if tok in eos:
                            return Proposal(draft[:i], n), end
                return Proposal(draft, n), end
        if self._spelling is not None:
            return Proposal(self._spelled_lookup(k), SPELLED_KEY), -1
        return Proposal(), -1
