"""Repetition, presence and frequency penalties applied per verification row, so speculation stays lossless.

A penalty depends on the history before the token being chosen. Plain decoding chooses index ``t`` after the
prompt and the tokens generated before ``t``; a verification round chooses several indices in one forward, row
``i`` after the emitted tokens **and the draft tokens fed before it** (a draft tree's row: the tokens on its own
path). `Penalties.apply` penalises every row by exactly that history, so a row whose draft prefix is accepted
gets the logits plain decoding gets at that index, bit for bit, and chooses the same token, greedy or keyed.

The definitions (see `SamplingOptions`): transformers' ``RepetitionPenaltyLogitsProcessor`` over the prompt and
the generated tokens (``logit * p`` where negative, ``logit / p`` otherwise, in float32), then OpenAI's
``logit - frequency_penalty * count - presence_penalty * (count > 0)`` over the generated tokens only, in the
order vLLM applies them. Only the columns of tokens in some row's history change, so the work is proportional to
the distinct tokens seen, not to the vocabulary.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from lattice_inference.sampling import SamplingOptions


def row_paths(tokens: Sequence[int], parents: Sequence[int] | None) -> list[list[int]]:
    """The fed tokens each row's choice comes after beyond the already emitted ones: row 0 (the pending token,
    already emitted) adds none; row ``r`` adds its parent's tokens and its own ``tokens[r]``. ``parents=None``
    is a chain (row ``r``'s parent is ``r - 1``)."""
    paths: list[list[int]] = [[]]
    for r in range(1, len(tokens)):
        paths.append([*paths[r - 1 if parents is None else parents[r]], int(tokens[r])])
    return paths


class Penalties:
    """One generation's penalty state: the prompt's distinct tokens and the counts of the generated ones."""

    def __init__(self, options: SamplingOptions, prompt_ids: Iterable[int]) -> None:
        self.repetition = float(options.repetition_penalty)
        self.presence = float(options.presence_penalty)
        self.frequency = float(options.frequency_penalty)
        self.prompt = frozenset(int(t) for t in prompt_ids)
        self.generated: Counter[int] = Counter()

    def extend(self, tokens: Iterable[int]) -> None:
        """Count newly emitted tokens (they are history for every later choice)."""
        self.generated.update(int(t) for t in tokens)

    def apply(self, logits: torch.Tensor, tokens: Sequence[int], parents: Sequence[int] | None = None) -> torch.Tensor:
        """``logits`` (``[rows, vocab]``, rows fed as ``tokens`` with ``parents`` as in `row_paths`) penalised,
        each row by its own history, in float32; a new tensor (``logits`` is left as it is, raw, for the
        log-probabilities)."""
        paths = row_paths(tokens, parents)
        drafted = {t for path in paths for t in path}
        columns = sorted(self.prompt | self.generated.keys() | drafted)
        out = logits.float().clone()
        position = {t: i for i, t in enumerate(columns)}
        on_path = torch.zeros(len(paths), len(columns))
        rows = torch.tensor([r for r, path in enumerate(paths) for _ in path], dtype=torch.long)
        cols = torch.tensor([position[t] for path in paths for t in path], dtype=torch.long)
        on_path.index_put_((rows, cols), torch.ones(len(rows)), accumulate=True)
        counts = (on_path + torch.tensor([float(self.generated[t]) for t in columns])).to(out.device)
        index = torch.tensor(columns, device=out.device)
        x = out[:, index]
        if self.repetition != 1:
            before = torch.tensor([t in self.prompt or t in self.generated for t in columns])
            seen = (before | (on_path > 0)).to(out.device)
            x = torch.where(seen, torch.where(x < 0, x * self.repetition, x / self.repetition), x)
        if self.frequency:
            x = x - self.frequency * counts
        if self.presence:
            x = x - self.presence * (counts > 0).float()
        out[:, index] = x
        return out
