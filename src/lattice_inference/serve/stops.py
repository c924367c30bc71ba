"""Stop strings over streamed text: cut the output before the first stop string, as OpenAI does.

Text arrives in pieces, and a stop string may straddle two of them, so any tail of the text seen so far that
could still grow into a stop string is held back until the next piece settles it (or generation ends). The
result is the text cut before the earliest-beginning stop string, however it was split: speculative decoding
emits the same text in other chunks than plain decoding, and must stop at the same place.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed text pieces with `push`; it returns what is safe to release and whether a stop string was hit."""

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Add ``text``; return the text that can be released now (``stopped`` turns true at a stop string)."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buffer = self._held + text
        pending = len(buffer) - self._partial_stop_length(buffer)  # where a stop may still begin
        hit = self._first_hit(buffer)
        if hit is not None and hit <= pending:
            self.stopped = True
            self._held = ""
            return buffer[:hit]
        # No stop yet, or one whose start a longer stop beginning earlier may still precede: hold from there, so
        # the cut is the same however the text was split (as when the whole text is cut at once).
        self._held = buffer[pending:]
        return buffer[:pending]

    def flush(self) -> str:
        """Release the held-back tail at the end of generation, cut at a stop string it holds."""
        held, self._held = self._held, ""
        if self.stopped:
            return ""
        hit = self._first_hit(held)
        if hit is not None:
            self.stopped = True
            return held[:hit]
        return held

    def _first_hit(self, text: str) -> int | None:
        """Where the earliest stop string in ``text`` begins, or None."""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
