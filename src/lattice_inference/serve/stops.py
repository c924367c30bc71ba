"""Stop strings over streamed text: cut the output before the first stop string, as OpenAI does.

Text arrives in pieces, and a stop string may straddle two of them, so any tail of the text seen so far that
could still grow into a stop string is held back until the next piece settles it (or generation ends).
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
        hits = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buffer[: min(hits)]
        keep = self._partial_stop_length(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Release the held-back tail at the end of generation (it never became a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
