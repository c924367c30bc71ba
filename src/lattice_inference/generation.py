"""One generation: its per-generation state while it runs, and its result.

Everything that belongs to a single generation (the prompt, the budget, the sampling options with the seed
actually used, the sampler and its noise cache, the drafter's state, the metrics, the stop reason and the tokens
emitted so far) lives in one `Generation` object, never on the decoder, the drafter or the model, so one loaded
model can serve several generations in turn.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from lattice_inference.draft_planner import DraftPlanner
from lattice_inference.drafters.base import DrafterState
from lattice_inference.drafters.suffix_index import SuffixIndex
from lattice_inference.errors import ConfigError
from lattice_inference.grammar import GrammarError, GrammarState
from lattice_inference.metrics import GenerationMetrics
from lattice_inference.penalties import Penalties
from lattice_inference.sampling import GreedySampler, KeyedSampler, SamplingOptions, make_sampler
from lattice_inference.targets.base import TargetSequence


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target's own distribution at its index (the log-softmax, in
    float32, of the verification row that chose it, before penalties, temperature and the other processors, as
    vLLM reports them by default), and the ``top`` most likely tokens there with theirs, most likely first. A
    decode-matched target's rows equal plain decoding's steps bit for bit, so these equal plain decoding's."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def row_logprob(row: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`TokenLogprob` of ``token`` from one row of logits (``[vocab]``), with the ``top`` most likely tokens."""
    logprobs = torch.log_softmax(row.float(), dim=-1)
    best = torch.topk(logprobs, top) if top else None
    ranked = () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist(), strict=True))
    return TokenLogprob(token, float(logprobs[token]), ranked)


def _no_chunks() -> Generator[list[int], None, None]:
    """The chunks of a generation that has not been started."""
    yield from ()


@dataclass
class GenerationResult:
    """Generated token ids (without a final EOS), why generation stopped, its metrics and how it sampled.

    ``seed`` is the seed the tokens were sampled with (drawn at random when none was given; None when greedy):
    passing it again reproduces ``token_ids`` with any method. ``text`` is filled by the text API (`Generator`).
    """

    token_ids: list[int]
    stop_reason: str
    """``"eos"`` when the model emitted an EOS token, ``"length"`` when ``max_new_tokens`` ran out."""
    metrics: GenerationMetrics
    seed: int | None = None
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    """One `TokenLogprob` per token of ``token_ids`` when asked for (``logprobs=N``), else None."""


class Generation:
    """A generation in progress: iterate over it for the token chunks, one per verification round, as they are
    accepted; `result` runs it to the end. Built by `SpeculativeDecoder.start`."""

    def __init__(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingOptions,
        vocab: int,
        logprobs: int | None = None,
    ) -> None:
        self.prompt_ids = prompt_ids
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling.seeded()
        self.sampler: GreedySampler | KeyedSampler = make_sampler(self.sampling, vocab)
        self.penalties = Penalties(self.sampling, prompt_ids) if self.sampling.penalised else None
        """The history-dependent penalties (None: all off), counting each emitted token."""
        bias = self.sampling.logit_bias
        outside = [t for t, _ in bias if t >= vocab]
        if outside:
            raise ConfigError(f"logit_bias token id {outside[0]} is outside the vocabulary of size {vocab}")
        self._bias = (torch.tensor([t for t, _ in bias]), torch.tensor([b for _, b in bias])) if bias else None
        self.metrics = GenerationMetrics(prompt_tokens=len(prompt_ids))
        self.stop_reason = ""
        self.planner: DraftPlanner | None = None
        """This generation's adaptive draft planner (None: fixed draft lengths, or no drafter)."""
        self.suffix_index: SuffixIndex | None = None
        """The cross-request index this generation drafts from and is added to (None: its own tokens only)."""
        self.scope: str | None = ""
        """Whose learned acceptance the planner starts from and leaves its own to (`SpeculativeDecoder.start`)."""
        self.prediction: list[int] | None = None
        """The request's predicted output as token ids (OpenAI's ``prediction``; None: none), drafted from first."""
        self.drafter_state: DrafterState | None = None
        """What the drafter knows about this generation's sequence (`Drafter.start`; None: no drafter)."""
        self.token_ids: list[int] = []
        self.from_draft: list[bool] = []
        """Per emitted token, whether it came from an accepted draft (else the target chose it itself)."""
        self.top_logprobs = logprobs
        """How many most likely tokens each `TokenLogprob` lists (None: log-probabilities are not computed)."""
        self.logprobs: list[TokenLogprob] = []
        """One `TokenLogprob` per emitted token (where ``top_logprobs`` is set), appended as rounds accept them."""
        self.pending = -1
        """The newest token, chosen and not fed yet (the next round feeds it first)."""
        self.created_at = time.perf_counter()
        """When the generation was made (`GenerationMetrics.latency_s` counts from here)."""
        self.opened_at: float | None = None
        """When the prefill ended (`SpeculativeDecoder.open`; None: not started)."""
        self.grammar: GrammarState | None = None
        """Where this generation stands in its grammar (structured output; None: unconstrained)."""
        self.sequence: TargetSequence | None = None
        """This generation's own sequence on the target (its cache slot, length and what its forwards produced):
        made when it opens (`SpeculativeDecoder.open`), released when it closes."""
        self.prompt_left: list[int] = []
        """The prompt tokens still to take in where it is taken in by chunks (`SpeculativeDecoder.open` with
        ``chunk``: each batch step feeds the next chunk beside the other generations' rounds); empty otherwise."""
        self.opening_at: float | None = None
        """When its prefill began (`GenerationMetrics.prefill_s` runs from here to ``opened_at``)."""
        self._chunks: Generator[list[int], None, None] = _no_chunks()

    def scores(self, logits: torch.Tensor, tokens: Sequence[int], parents: Sequence[int] | None = None) -> torch.Tensor:
        """The logits the sampler chooses from, each row as plain decoding would see it at that index: ``logits``
        (rows fed as ``tokens``, a chain or a tree with ``parents``) penalised by the row's own history
        (`Penalties.apply`), then ``logit_bias`` added, then, under a grammar, the tokens it disallows after the
        emitted tokens and the draft before the row (``tokens[1:]`` of a chain) at minus infinity. ``logits`` is
        left raw (the log-probabilities come from it); as they are when none of these is on."""
        out = self._adjusted(logits, tokens, parents)
        if self.grammar is not None:
            if parents is not None:
                raise GrammarError("a draft tree cannot be verified under a grammar")
            out = self.grammar.constrain(out, tokens[1:])
        return out

    def _adjusted(self, logits: torch.Tensor, tokens: Sequence[int], parents: Sequence[int] | None) -> torch.Tensor:
        """`scores` before the grammar's mask: ``logits`` penalised, then ``logit_bias`` added."""
        out = logits if self.penalties is None else self.penalties.apply(logits, tokens, parents)
        if self._bias is not None:
            ids, values = self._bias
            out = out.float().clone() if out is logits else out
            out[:, ids.to(out.device)] += values.to(out.device)
        return out

    def choose(self, logits: torch.Tensor, tokens: Sequence[int], first_index: int) -> list[int]:
        """The token each row of a chain (``logits``, rows fed as ``tokens``; row ``i`` chooses sequence index
        ``first_index + i``) chooses from its `scores`. Greedy under a grammar, a row's mask is computed only where
        the grammar refuses the row's own argmax (`GrammarState.choose_greedy`: the same choice, without a mask per
        row), and rows past the first that disagrees with the draft (``tokens[1:]``) are not chosen (``-1``)."""
        if self.grammar is not None and self.sampler.greedy:
            return self.grammar.choose_greedy(self._adjusted(logits, tokens, None), tokens[1:])
        return self.sampler.choose(self.scores(logits, tokens), first_index)

    @property
    def seed(self) -> int | None:
        """The seed in use (None when greedy)."""
        return self.sampling.seed

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        return next(self._chunks)  # the batch that runs it (a batch of one, alone) keeps ``token_ids``

    def close(self) -> None:
        """Stop early: the decode loop's cleanup runs now (its metrics get their decode time), not when the
        object is dropped. Iterating afterwards yields nothing more."""
        self._chunks.close()

    def result(self) -> GenerationResult:
        """Run to the end and return every generated token with the metrics."""
        for _ in self:
            pass
        return self.outcome()

    def outcome(self) -> GenerationResult:
        """What the generation has produced so far, as a `GenerationResult` (`result` once it has run to the end;
        a `lattice_inference.batching.Batch` runs it without iterating)."""
        return GenerationResult(
            token_ids=list(self.token_ids),
            stop_reason=self.stop_reason,
            metrics=self.metrics,
            seed=self.seed,
            sampling=self.sampling,
            logprobs=None if self.top_logprobs is None else list(self.logprobs),
        )
