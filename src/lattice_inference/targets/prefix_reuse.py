"""Which cached rows a new prompt may reuse: the token ids behind a target's cache rows, and whether those rows
are the ones a fresh prefill of the new prompt would compute.

Agentic and multi-turn work sends prompts that start with the previous request's prompt and answer (a
conversation), or with the same system prompt and document (an edit loop, questions over one file). Its prefill
is then mostly recomputation of rows the cache already holds. Reusing them is lossless only where every such row
is bit for bit what a fresh prefill would compute: a row's keys and values depend on its token, its position and
the rows before it, so they match exactly when every row, prompt and generated alike, was computed by one
instruction sequence that does not depend on how many rows a forward holds or where it starts (`LeanTarget`'s
native layer loop, the same code a fresh prefill runs). A target records here the ids of its cache rows as it
feeds, rolls back and keeps them, and under which settings they were computed (`RowKey`: dtype, the cache's dtype,
thread count and the owner, e.g. a server's tenant); a prefill under other settings, or of a prompt a fresh prefill
would compute another way, reuses nothing.

Beside its live cache a target keeps the caches of its earlier sequences (`KeptSequences`, LRU, under a token
budget), so that work that alternates between contexts (two conversations, an agent returning to a file after a
detour, a regenerated answer after other requests) still finds its rows; a prefill takes whichever holds the
longest prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from lattice_inference.verify import common_prefix

C = TypeVar("C")

RowKey = tuple[object, ...]
"""What decides how a row is computed beyond its token and position (dtype, thread count), and last whose rows
they are (the owner): rows cached under one key are reused only by a prefill under the same key."""


@dataclass
class CachedRows:
    """The token ids of a target's cache rows, in position order, and the `RowKey` they were computed under (None:
    the rows are not reusable, e.g. a prefill computed them by a kernel that depends on the row count)."""

    tokens: list[int] = field(default_factory=list)
    key: RowKey | None = None

    def fed(self, token_ids: Sequence[int]) -> None:
        """Rows for ``token_ids`` were written after the current ones (a forward, or a draft tree's rows in the
        order fed)."""
        self.tokens.extend(token_ids)

    def rollback(self, length: int) -> None:
        """Rows at positions ``>= length`` were dropped."""
        del self.tokens[length:]

    def keep(self, start: int, rows: Sequence[int]) -> None:
        """Of the rows fed at ``start``, those listed (a path of a draft tree) now sit at ``start ..``."""
        fed = self.tokens[start:]
        self.tokens[start:] = [fed[r] for r in rows]

    def owned_by(self, owner: object) -> bool:
        """Whether these rows are reusable and ``owner``'s (the last element of their key)."""
        return self.key is not None and self.key[-1] == owner

    def reusable(self, prompt: Sequence[int], key: RowKey) -> int:
        """How many leading rows a prefill of ``prompt`` under ``key`` may keep: the longest common prefix of the
        cached ids and ``prompt``, at most ``len(prompt) - 1`` (the last prompt row is always fed, as its logits
        choose the first token); 0 where the rows were computed under another key or are not reusable."""
        if self.key is None or self.key != key:
            return 0
        return reusable_rows(self.tokens, prompt)


def reusable_rows(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """How many rows of ``cached`` ids a prefill of ``prompt`` may keep: their longest common prefix, at most
    ``len(prompt) - 1`` (the last prompt row is always fed, as its logits choose the first token)."""
    return common_prefix(cached, prompt[: len(prompt) - 1])


class KeptSequences(Generic[C]):
    """Earlier sequences' caches (``C``) with their `CachedRows`, least recently used first, holding at most
    ``budget`` rows in all (a sequence longer than the budget is not kept), and none kept past the keep that finds
    ``low_memory()`` true."""

    def __init__(self, budget: int, low_memory: Callable[[], bool] = lambda: False) -> None:
        self.budget = budget
        self._low_memory = low_memory
        self._kept: list[tuple[CachedRows, C]] = []

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def tokens(self) -> int:
        """Rows held over every kept sequence."""
        return sum(len(rows.tokens) for rows, _ in self._kept)

    def best(self, prompt: Sequence[int], key: RowKey) -> tuple[int, int]:
        """The kept sequence from which a prefill of ``prompt`` under ``key`` may keep the most rows, and how many
        (``(-1, 0)`` where none has any)."""
        found, most = -1, 0
        for i, (rows, _) in enumerate(self._kept):
            n = rows.reusable(prompt, key)
            if n > most:
                found, most = i, n
        return found, most

    def take(self, index: int) -> tuple[CachedRows, C]:
        """Remove and return the kept sequence at ``index`` (it becomes the live one)."""
        return self._kept.pop(index)

    def keep(self, rows: CachedRows, cache: C) -> None:
        """Keep a sequence that stops being live, if it is reusable at all, dropping the least recently used ones
        while the rows held pass ``budget`` or the machine runs low on memory (then every kept one is dropped, this
        one too: the memory goes back before the next prefill allocates)."""
        if rows.key is None or not rows.tokens or len(rows.tokens) > self.budget:
            return
        self._kept.append((rows, cache))
        while self.tokens > self.budget:
            del self._kept[0]
        if self._low_memory():
            self._kept.clear()

    def drop_oldest(self) -> bool:
        """Drop the least recently used kept sequence (its cache, and a cache slot it holds); False where none is
        kept."""
        if not self._kept:
            return False
        del self._kept[0]
        return True

    def forget(self, owner: object = None) -> None:
        """Drop every kept sequence, or only ``owner``'s (the last element of its key)."""
        self._kept = [(r, c) for r, c in self._kept if owner is not None and not r.owned_by(owner)]
