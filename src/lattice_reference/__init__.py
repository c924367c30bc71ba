"""The original n-gram speculation API (``NgramSpeculator``, ``argmax``, ``verify_draft``,
``generate_with_speculation``), ported to Python with its bugs fixed.

This module is for callers that own a single-token forward function ``forward_fn(token_id, position) ->
logits``. It keeps the original names and signatures, but :func:`generate_with_speculation` follows the corrected
protocol (every token fed exactly once at position == its index, ``draft[0]`` checked against the model, the
correction or bonus token always emitted, ``max_new_tokens`` never exceeded, EOS only from the model), so its
output equals plain greedy decoding of the same model.

It does **one forward call per token**, exactly as many as plain greedy decoding, so it gives no speed-up: it is
the reference-compatible API. The fast path verifies a whole draft in one batched forward (the decode loop
elsewhere in this package).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from lattice_inference.drafters.ngram import NgramDrafter, NgramIndex, validate_token_ids
from lattice_inference.errors import ConfigError, TokenError

__all__ = ["NgramSpeculator", "argmax", "generate_with_speculation", "verify_draft"]

L = TypeVar("L")
ForwardFn = Callable[[int, int], Any]


def argmax(logits: Any) -> int:
    """Index of the largest logit, with ``torch.argmax`` tie-breaking: the **first** maximal index wins.

    NaN values never win (they are ignored); an empty input, or one that is all NaN, gives 0. Accepts a
    sequence of numbers, a 1-D numpy array or a 1-D torch tensor (any float dtype, including bf16).

    Raises:
        TokenError: ``logits`` is not one-dimensional.
    """
    if type(logits).__module__.startswith("torch"):
        import torch

        if logits.dim() != 1:
            raise TokenError(f"logits must be 1-D, got shape {tuple(logits.shape)}")
        if logits.numel() == 0:
            return 0
        if logits.is_floating_point() or logits.is_complex():
            keep = ~torch.isnan(logits)
            if not bool(keep.all()):
                if not bool(keep.any()):
                    return 0
                kept = torch.nonzero(keep).squeeze(1)
                return int(kept[int(torch.argmax(logits[kept]))])
        return int(torch.argmax(logits))
    values = np.asarray(logits)
    if values.ndim != 1:
        raise TokenError(f"logits must be 1-D, got shape {values.shape}")
    if values.size == 0:
        return 0
    if values.dtype.kind not in "biuf":
        values = values.astype(np.float64)
    if values.dtype.kind == "f":
        keep = ~np.isnan(values)
        if not keep.all():
            if not keep.any():
                return 0
            kept = np.flatnonzero(keep)
            return int(kept[int(np.argmax(values[kept]))])
    return int(np.argmax(values))


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


class NgramSpeculator:
    """Prompt-lookup speculator with the original API's exact semantics (searches the **prompt only**).

    :meth:`speculate` tries ``n`` from ``min(max_ngram, len(recent_tokens))`` down to 2; the first occurrence in
    the prompt of the last ``n`` recent tokens wins if it has at least one following prompt token, which are
    proposed (up to ``max_draft``). Lookups use an :class:`~lattice_inference.drafters.ngram.NgramIndex` built
    once over the prompt, so each costs O(max_ngram) instead of a scan of the prompt.

    Args:
        prompt_tokens: the tokenised prompt.
        max_ngram: longest n-gram tried (>= 2; the original silently never drafted below 2).
        max_draft: most tokens proposed per call (>= 1).

    Raises:
        ConfigError: ``max_ngram < 2`` or ``max_draft < 1``.
        TokenError: a prompt token is negative or not an integer.
    """

    def __init__(self, prompt_tokens: Sequence[int], max_ngram: int = 5, max_draft: int = 4) -> None:
        self.max_ngram = _check_int("max_ngram", max_ngram, 2)
        self.max_draft = _check_int("max_draft", max_draft, 1)
        self.prompt_tokens: list[int] = validate_token_ids(prompt_tokens, "prompt_tokens")
        # Lengths 1..max_ngram cover every speculate() lookup and short find_ngram() patterns.
        self._index = NgramIndex(1, self.max_ngram, keep="first")
        self._index.extend(self.prompt_tokens)
        self._long_indexes: dict[int, NgramIndex] = {}

    def _index_for(self, n: int) -> NgramIndex:
        if n <= self.max_ngram:
            return self._index
        index = self._long_indexes.get(n)
        if index is None:  # Only find_ngram() asks for n > max_ngram: index that length once.
            index = self._long_indexes[n] = NgramIndex(n, n, keep="first")
            index.extend(self.prompt_tokens)
        return index

    def speculate(self, recent_tokens: Sequence[int]) -> list[int]:
        """Draft tokens to follow ``recent_tokens`` by n-gram lookup in the prompt (possibly none).

        Reads only the last ``max_ngram`` recent tokens (by index), so a call costs the same at any context
        length."""
        size = len(recent_tokens)
        recent = [recent_tokens[i] for i in range(max(0, size - self.max_ngram), size)]
        prompt = self.prompt_tokens
        for n in range(min(self.max_ngram, len(recent)), 1, -1):
            pos = self.find_ngram(recent[len(recent) - n :])
            if pos is not None:
                start = pos + n
                end = min(start + self.max_draft, len(prompt))
                if start < end:
                    return prompt[start:end]
        return []

    def find_ngram(self, pattern: Sequence[int]) -> int | None:
        """Start index of the first occurrence of ``pattern`` in the prompt, or None (also for an empty one)."""
        n = len(pattern)
        if n == 0 or n > len(self.prompt_tokens):
            return None
        end = self._index_for(n).lookup(list(pattern))
        return None if end is None else end - n + 1


def verify_draft(
    draft_tokens: Sequence[int],
    position_start: int,
    forward_fn: Callable[[int, int], L],
) -> tuple[int, list[L]]:
    """Feed draft tokens one at a time while the model agrees with the next one (the original API's contract).

    Calls ``forward_fn(draft_tokens[i], position_start + i)`` for i = 0, 1, ... and stops after the first call
    whose argmax differs from ``draft_tokens[i + 1]`` (or after the last token).

    **Precondition:** ``draft_tokens[0]`` was already verified by the caller (the model's prediction before it,
    from the logits of the previous token, equals it). This function never checks ``draft_tokens[0]``; it only
    checks ``draft_tokens[1:]``.

    Returns:
        ``(accepted, logits)``: the number of draft tokens fed (>= 1 for a non-empty draft; every fed token is
        accepted under the precondition) and the logits of each call. ``argmax(logits[accepted - 1])`` is the
        model's next token: the correction when ``accepted < len(draft_tokens)``, otherwise the bonus token.
    """
    draft = validate_token_ids(draft_tokens, "draft_tokens")
    position = _check_int("position_start", position_start, 0)
    accepted = 0
    all_logits: list[L] = []
    for i, token in enumerate(draft):
        logits = forward_fn(token, position + i)
        all_logits.append(logits)
        accepted += 1
        if i + 1 < len(draft) and argmax(logits) != draft[i + 1]:
            break
    return accepted, all_logits


def generate_with_speculation(
    prompt_tokens: Sequence[int],
    max_new_tokens: int,
    eos_token: int | None,
    forward_fn: ForwardFn,
    max_ngram: int = 5,
    max_draft: int = 4,
) -> list[int]:
    """Greedy generation with n-gram drafts through a single-token ``forward_fn(token_id, position)``.

    **Precondition:** the model has already processed ``prompt_tokens[:-1]`` at positions ``0 .. P-2``
    (``P = len(prompt_tokens)``); the last prompt token is *pending* and is the first token this function feeds,
    at position ``P-1``. Every token is then fed exactly once, at position == its index in prompt + output.

    Each step feeds the pending token; the resulting argmax is the model's next token. If an n-gram draft
    (searched over the prompt **and** the generated tokens, n = ``max_ngram`` down to 2, first occurrence,
    truncated before the first EOS) starts with that token, :func:`verify_draft` feeds the draft while the model
    agrees, and the model's correction or bonus token is always emitted after the accepted part. Generation
    stops at EOS (not included in the output) or after ``max_new_tokens`` tokens, never more. The output is
    exactly the plain greedy decoding of the same model (``argmax`` ties go to the lowest id).

    This path does **one forward call per token**, the same count as plain greedy decoding, so it gives no
    speed-up: it is the reference-compatible API. Real speed comes from verifying a draft in one batched forward
    (the decode loop elsewhere in this package).

    Args:
        prompt_tokens: the tokenised prompt (non-empty).
        max_new_tokens: generation budget (>= 0).
        eos_token: stop token id, or None to never stop early.
        forward_fn: ``(token_id, position) -> logits`` (anything :func:`argmax` accepts).
        max_ngram: longest n-gram to match (>= 2).
        max_draft: most draft tokens per step (>= 1).

    Returns:
        The generated token ids (without the prompt and without EOS).

    Raises:
        TokenError: the prompt is empty, or a token id (prompt or ``eos_token``) is negative or not an int.
        ConfigError: ``max_new_tokens < 0``, ``max_ngram < 2`` or ``max_draft < 1``.
    """
    tokens = validate_token_ids(prompt_tokens, "prompt_tokens")
    if not tokens:
        raise TokenError("prompt_tokens is empty; at least one token is needed (the pending last token)")
    budget = _check_int("max_new_tokens", max_new_tokens, 0)
    max_ngram = _check_int("max_ngram", max_ngram, 2)
    max_draft = _check_int("max_draft", max_draft, 1)
    eos: tuple[int, ...] = ()
    if eos_token is not None:
        eos = tuple(validate_token_ids([eos_token], "eos_token"))

    drafter = NgramDrafter(max_ngram=max_ngram, min_ngram=2, max_draft=max_draft, eos_token_ids=eos)
    state = drafter.start(tokens)
    out: list[int] = []
    while len(out) < budget:
        pending = len(tokens) - 1  # position (== index) of the last, not yet fed, token
        nxt = argmax(forward_fn(tokens[-1], pending))
        # A step emits the accepted draft plus one model token, so at most (budget left - 1) draft tokens.
        draft = state.propose(budget - len(out) - 1)
        if draft and draft[0] == nxt:
            accepted, logits = verify_draft(draft, pending + 1, forward_fn)
            new = [*draft[:accepted], argmax(logits[accepted - 1])]
        else:
            new = [nxt]
        for token in new:
            if token in eos:
                return out
            out.append(token)
            tokens.append(token)
        state.extend(new)
    return out
