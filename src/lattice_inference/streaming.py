"""Incremental detokenisation: turn token chunks into text chunks as they are accepted.

Byte-level tokenizers can split one character across tokens, so text is only released once it no longer ends
in a partial character (U+FFFD), and always as the difference from what was already released.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from transformers import PreTrainedTokenizerBase


class TextStream:
    """Accumulates token ids and returns the newly completed text after each `push`."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self._released = 0

    def _decode(self, token_ids: Sequence[int]) -> str:
        return cast(str, self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def _text(self) -> str:
        return self._decode(self.token_ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add ``token_ids``; return the text they complete (possibly empty)."""
        self.token_ids.extend(token_ids)
        text = self._text()
        if text.endswith("\ufffd"):
            return ""
        new, self._released = text[self._released :], len(text)
        return new

    def flush(self) -> str:
        """Return whatever text is still held back (e.g. a trailing partial character)."""
        text = self._text()
        new, self._released = text[self._released :], len(text)
        return new

    def tokens_covering(self, released: str) -> int:
        """The fewest leading tokens whose text begins with ``released`` (text cut before a stop string).

        This is how many tokens a client received: a function of the generated sequence and the released text
        only, not of how far the last decode round ran past the stop string (which depends on the draft
        planner's timed choices), so the count is the same for the same request whatever else runs.
        """
        count = len(self.token_ids)
        while count > 0 and self._decode(self.token_ids[: count - 1]).startswith(released):
            count -= 1
        return count

    def tokens_within(self, released: str, start: int = 0) -> int:
        """The most leading tokens (at least ``start``) whose whole text lies within ``released``: those whose
        log-probabilities can go out with it (a token completing a character split across tokens counts only
        once the character does)."""
        within = start
        for count in range(start + 1, len(self.token_ids) + 1):
            if released.startswith(self._decode(self.token_ids[:count])):
                within = count
        return within

    def offset_of(self, index: int) -> int:
        """Where token ``index``'s text starts in the decoded text: the length of the text before it."""
        return len(self._decode(self.token_ids[:index]).removesuffix("\ufffd"))

    @property
    def text(self) -> str:
        """All text decoded so far."""
        return self._text()
