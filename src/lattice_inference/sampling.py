"""Sampling options, transformers' logits processors, and the keyed Gumbel-max sampler.

Penalties (``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``) change the raw logits before
everything below, as transformers and vLLM apply them; they depend on the history, so the decode loop applies
them per verification row (`lattice_inference.penalties`) and the samplers here see the penalised logits.

**Keyed sampling.** The token at sequence index ``t`` (its index in the full sequence, prompt included: the
first generated token of a ``P``-token prompt has index ``P``) is ``argmax(processed_logits_t + g_t)``, where
``processed_logits_t`` are the model's logits after temperature, top-k, top-p and min-p (transformers'
definitions and order, in float32) and ``g_t`` is standard Gumbel noise over the vocabulary drawn from a Philox
counter-based generator keyed by ``(seed, t)``. Gumbel-max makes each token an exact draw from
``softmax(processed_logits_t)``; keying the noise by position (not by how many draws came before) makes the
token a function of ``(logits_t, seed, t)`` only. Plain decoding and every speculative method compute the same
logits for index ``t`` (verification rows included), so with the same seed they emit the same tokens, and
verification stays "accept the longest draft prefix equal to the target's choices". Greedy decoding is the
``temperature == 0`` case: plain argmax, first index on ties.

The noise is drawn on the CPU (numpy's Philox with a 128-bit key ``(seed mod 2**64, t)``), so it does not depend
on the device either; it is cached for the few positions a verification round may score again.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Protocol

import numpy as np
import torch

from lattice_inference.errors import ConfigError

_MASK64 = (1 << 64) - 1
_TINY = float(np.finfo(np.float32).tiny)

#: The history-dependent penalties of `SamplingOptions` (see `lattice_inference.penalties`).
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
#: OpenAI's range for ``presence_penalty`` and ``frequency_penalty`` (vLLM's too).
PENALTY_RANGE = (-2.0, 2.0)
#: OpenAI's range for a ``logit_bias`` value, and the most tokens one request may bias (OpenAI's limit).
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS = 300


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingOptions:
    """How each token is chosen. ``temperature == 0`` (the default) is greedy decoding; above 0 the token is
    sampled from the logits processed by temperature, then ``top_k`` (0: off), ``top_p`` (1: off), ``min_p``
    (0: off), as transformers' ``generate`` applies them. ``seed`` makes sampling reproducible: the same seed
    gives the same tokens with or without speculation (None: a random seed is drawn per generation).

    Penalties apply to the raw logits first, greedy or sampled (greedy then takes the argmax of the penalised
    logits): ``repetition_penalty`` (transformers' definition, 1: off, > 0) divides the positive logits and
    multiplies the negative ones of every token already in the sequence, **prompt included**;
    ``frequency_penalty`` and ``presence_penalty`` (OpenAI's definitions, 0: off, -2..2) subtract
    ``frequency_penalty * count + presence_penalty * (count > 0)`` from each token's logit, where ``count`` is
    how often it was **generated** so far (the prompt does not count). ``logit_bias`` (OpenAI's: token id and a
    bias in -100..100, as `bias_pairs` makes them) is added to those tokens' logits after the penalties, in every
    row alike. Log-probabilities stay those of the raw logits."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        t, k, p, m, s = self.temperature, self.top_k, self.top_p, self.min_p, self.seed
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ConfigError(f"temperature must be a finite number >= 0 (0 is greedy), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 disables it), got {k!r}")
        if not _is_real(p) or not 0 < p <= 1:
            raise ConfigError(f"top_p must be in (0, 1] (1 disables it), got {p!r}")
        if not _is_real(m) or not 0 <= m <= 1:
            raise ConfigError(f"min_p must be in [0, 1] (0 disables it), got {m!r}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, int)):
            raise ConfigError(f"seed must be an integer or None, got {s!r}")
        r = self.repetition_penalty
        if not _is_real(r) or not 0 < r < float("inf"):
            raise ConfigError(f"repetition_penalty must be a finite number > 0 (1 disables it), got {r!r}")
        low, high = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not low <= value <= high:
                raise ConfigError(f"{name} must be a number in [{low:g}, {high:g}] (0 disables it), got {value!r}")
        object.__setattr__(self, "logit_bias", bias_pairs(self.logit_bias))

    def penalties(self) -> dict[str, float]:
        """The penalties that are on (not at their neutral default), by field name."""
        return {
            name: getattr(self, name) for name in PENALTIES if getattr(self, name) != getattr(SamplingOptions, name)
        }

    @property
    def penalised(self) -> bool:
        """Whether any penalty is on (the decode loop then penalises each row's logits by its history)."""
        return bool(self.penalties())

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen by plain argmax (``temperature == 0``)."""
        return self.temperature == 0

    def seeded(self) -> SamplingOptions:
        """These options with a seed: the given one, or a freshly drawn one when sampling without a seed."""
        if self.greedy or self.seed is not None:
            return self
        return replace(self, seed=secrets.randbits(48))

    def to_dict(self) -> dict[str, object]:
        """JSON-ready fields."""
        return asdict(self)


def bias_pairs(
    bias: Mapping[int | str, float] | Iterable[tuple[int | str, float]] | None,
) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as `SamplingOptions` keeps it: ``(token id, bias)`` pairs sorted by id, from a mapping (OpenAI
    sends the ids as strings) or pairs; `ConfigError` names an id that is not a non-negative integer, a bias
    outside ``LOGIT_BIAS_RANGE`` or too many entries."""
    items = list((bias.items() if isinstance(bias, Mapping) else bias) or ())
    if len(items) > MAX_LOGIT_BIAS:
        raise ConfigError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(items)}")
    pairs: dict[int, float] = {}
    low, high = LOGIT_BIAS_RANGE
    for key, value in items:
        token = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.strip().isdigit():
            token = int(key)
        if token is None or token < 0:
            raise ConfigError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        if not _is_real(value) or not low <= value <= high:
            raise ConfigError(f"logit_bias of token {token} must be a number in [{low:g}, {high:g}], got {value!r}")
        pairs[token] = float(value)
    return tuple(sorted(pairs.items()))


def prompt_seed(seed: int | None, index: int) -> int | None:
    """The seed prompt ``index`` of a benchmark samples with: ``seed + index`` (None: greedy), the same for every
    method and engine, so each method's output can be compared with plain sampling's on that prompt."""
    return None if seed is None else seed + index


def divide_by_temperature(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """``x / temperature`` (float32 ``[..., vocab]``) as transformers' ``TemperatureLogitsWarper`` computes it, but
    without overflow: in a row where that quotient leaves the float32 range (a tiny temperature: 1e-38 is tiny
    enough for logits above 3.4, and below about 1.4e-45 the temperature itself is 0 in float32), the row is
    shifted by its maximum first and divided in float64, ``(x - max) / temperature``. Softmax does not change
    under the shift, so the row still defines softmax(x / temperature) exactly: its largest logits get 0 and
    the others a large negative number or -inf, an exact draw from which is the argmax (uniform among tied
    maxima), as the limit of a temperature going to 0 is. Rows that fit are bit for bit transformers'."""
    y = x / temperature
    overflowed = (~torch.isfinite(y) & torch.isfinite(x)).any(dim=-1, keepdim=True)
    if not bool(overflowed.any()):
        return y
    shifted = (x.double() - x.amax(dim=-1, keepdim=True).double()) / temperature
    return torch.where(overflowed, shifted.float(), y)


def process_logits(logits: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """``logits`` (``[..., vocab]``) in float32 after temperature, top-k, top-p and min-p, in that order, with
    transformers' definitions (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``,
    ``MinPLogitsWarper``, ``min_tokens_to_keep=1``); removed tokens get ``-inf``."""
    x = logits.float()
    if options.temperature not in (0, 1):
        x = divide_by_temperature(x, options.temperature)
    neg_inf = float("-inf")
    if options.top_k:
        kth = torch.topk(x, min(options.top_k, x.shape[-1])).values[..., -1:]
        x = x.masked_fill(x < kth, neg_inf)
    if options.top_p < 1:
        sorted_x, order = torch.sort(x, descending=False)
        remove = sorted_x.softmax(dim=-1).cumsum(dim=-1) <= 1 - options.top_p
        remove[..., -1:] = False
        x = x.masked_fill(remove.scatter(-1, order, remove), neg_inf)
    if options.min_p > 0:
        probs = x.softmax(dim=-1)
        remove = probs < options.min_p * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(-1, torch.topk(probs, 1).indices, False)
        x = x.masked_fill(remove, neg_inf)
    return x


def gumbel_noise(seed: int, index: int, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise ``[vocab]`` (float32, CPU) for sequence index ``index``: a pure function of
    ``(seed, index, vocab)``, from a Philox generator keyed by the pair."""
    rng = np.random.Generator(np.random.Philox(key=[seed & _MASK64, index & _MASK64]))
    g = rng.standard_exponential(vocab, dtype=np.float32)
    np.maximum(g, _TINY, out=g)
    np.log(g, out=g)
    return torch.from_numpy(np.negative(g, out=g))


class Sampler(Protocol):
    """Chooses the token at each sequence index from that index's logits (one generation's state)."""

    greedy: bool

    def choose(self, logits: torch.Tensor, first_index: int) -> list[int]:
        """The tokens for rows ``logits[i]`` (``[n, vocab]``), row ``i`` choosing sequence index ``first_index + i``."""
        ...

    def choose_at(self, logits: torch.Tensor, indices: Sequence[int]) -> list[int]:
        """The tokens for rows ``logits[i]``, row ``i`` choosing sequence index ``indices[i]`` (a draft tree's rows
        choose indices by their depth, so several rows may choose the same index)."""
        ...

    def choose_draft(self, scores: torch.Tensor, index: int, token_ids: torch.Tensor | None = None) -> int:
        """A drafter's token for index ``index`` from its own ``scores`` (``[vocab]``, or ``[len(token_ids)]``
        over the ids ``token_ids``), with the same noise the target's choice at ``index`` will use."""
        ...

    def rank_draft(self, scores: torch.Tensor, index: int, token_ids: torch.Tensor | None, count: int) -> list[int]:
        """The ``count`` best draft tokens for ``index``, best first, by the ranking `choose_draft` takes the first
        of (a draft tree verifies the runners-up beside the best)."""
        ...


def first_max(scores: torch.Tensor) -> list[int]:
    """The index of each row's first maximum (``scores``: ``[rows, n]``): ``torch.argmax``'s choice, ties to the
    lowest index. On the CPU through numpy, whose argmax (first occurrence too) takes about 3 us over a 49k-token
    row where torch's takes 70 us (2-core Xeon, AVX512_BF16): a greedy round chooses one row per verified token."""
    if scores.device.type != "cpu":
        return scores.argmax(dim=-1).tolist()
    rows = scores if scores.dtype in (torch.float32, torch.float64) else scores.float()
    return rows.detach().numpy().argmax(axis=-1).tolist()


class GreedySampler:
    """Plain argmax (first index on ties, as ``torch.argmax``: `first_max`)."""

    greedy = True
    seed: int | None = None

    def choose(self, logits: torch.Tensor, first_index: int) -> list[int]:
        return first_max(logits)

    def choose_at(self, logits: torch.Tensor, indices: Sequence[int]) -> list[int]:
        return first_max(logits)

    def choose_draft(self, scores: torch.Tensor, index: int, token_ids: torch.Tensor | None = None) -> int:
        best = first_max(scores.reshape(1, -1))[0]
        return best if token_ids is None else int(token_ids[best])

    def rank_draft(self, scores: torch.Tensor, index: int, token_ids: torch.Tensor | None, count: int) -> list[int]:
        return top_tokens(scores.reshape(-1), token_ids, count)


class KeyedSampler:
    """Gumbel-max sampling keyed by ``(seed, sequence index)``; see the module docstring.

    Noise vectors are cached by index: a verification round scores indices ``p+1 .. p+k+1`` and the next round
    starts after the accepted ones, so rejected indices are scored again. The cache drops indices below the
    first row of each `choose` (indices only move forward within a generation).
    """

    greedy = False

    def __init__(self, options: SamplingOptions, vocab: int) -> None:
        if options.greedy or options.seed is None:
            raise ConfigError("a keyed sampler needs temperature > 0 and a seed (use SamplingOptions.seeded())")
        self.options = options
        self.seed: int = options.seed
        self.vocab = vocab
        """Size of the full vocabulary (the noise of a drafter scoring a subset of it is this noise's subset)."""
        self._noise: dict[int, torch.Tensor] = {}

    def noise(self, index: int, vocab: int, device: torch.device) -> torch.Tensor:
        """Gumbel noise for ``index`` on ``device`` (cached)."""
        g = self._noise.get(index)
        if g is None or g.shape[0] != vocab or g.device != device:
            g = self._noise[index] = gumbel_noise(self.seed, index, vocab).to(device)
        return g

    def choose(self, logits: torch.Tensor, first_index: int) -> list[int]:
        return self.choose_at(logits, range(first_index, first_index + logits.shape[0]))

    def choose_at(self, logits: torch.Tensor, indices: Sequence[int]) -> list[int]:
        lowest = min(indices)
        for stale in [i for i in self._noise if i < lowest]:
            del self._noise[stale]
        vocab = logits.shape[-1]
        noise = [self.noise(i, vocab, logits.device) for i in indices]
        return first_max(process_logits(logits, self.options) + torch.stack(noise))

    def choose_draft(self, scores: torch.Tensor, index: int, token_ids: torch.Tensor | None = None) -> int:
        return self.rank_draft(scores, index, token_ids, 1)[0]

    def rank_draft(self, scores: torch.Tensor, index: int, token_ids: torch.Tensor | None, count: int) -> list[int]:
        g = self.noise(index, self.vocab if token_ids is not None else scores.shape[-1], scores.device)
        if token_ids is not None:
            g = g[token_ids]
        return top_tokens(process_logits(scores.reshape(-1), self.options) + g, token_ids, count)


def top_tokens(scores: torch.Tensor, token_ids: torch.Tensor | None, count: int) -> list[int]:
    """The ids of the ``count`` highest ``scores`` (``token_ids[i]`` names row ``i`` where given), best first; the
    first is ``torch.argmax``'s (first index on ties)."""
    first = first_max(scores.reshape(1, -1))[0]
    if count == 1:
        best = [first]
    else:
        best = torch.topk(scores, min(count, scores.shape[0])).indices.tolist()
        if best[0] != first:  # topk's order among equal scores is unspecified; argmax's is the contract
            best = [first, *(b for b in best if b != first)][: len(best)]
    return best if token_ids is None else token_ids[best].tolist()


def make_sampler(options: SamplingOptions, vocab: int) -> GreedySampler | KeyedSampler:
    """The sampler of one generation (``options`` must be `SamplingOptions.seeded` when sampling)."""
    return GreedySampler() if options.greedy else KeyedSampler(options, vocab)
