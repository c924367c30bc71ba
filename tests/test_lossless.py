"""Losslessness on real transformers models: speculative output == ``model.generate(do_sample=False)``.

Seven architectures (Qwen3, Llama, Qwen2, Mistral with a sliding window shorter than the sequence, Gemma,
Gemma2 with sliding window, Phi3), random weights in float32, two inits each: std 0.02 (the model loops, so
n-gram drafts are mostly accepted) and std 0.5 (diverse output, so drafts are mostly rejected). Prompts are
random or built from repeated spans so that prompt lookup fires. An oracle drafter that corrupts some of its
tokens forces full acceptance, partial acceptance and immediate rejection on every architecture.
"""

from __future__ import annotations

import random
import zlib

import pytest

from lattice_inference.decode import SpeculativeDecoder
from lattice_inference.drafters.ngram import NgramDrafter
from lattice_inference.metrics import GenerationMetrics
from lattice_inference.targets import TransformersTarget
from lattice_testing.toy import TOY_ARCHITECTURES, TOY_VOCAB, toy_config, toy_model

from .helpers import OracleDrafter, RecordingTarget, hf_generate

NEW_TOKENS = 40
VOCAB = TOY_VOCAB


def hf_greedy(model, prompt: list[int], max_new: int, eos: int | None) -> list[int]:
    """Plain greedy decoding by transformers, without the final EOS."""
    return hf_generate(model, prompt, max_new, eos)


def make_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 40))] for _ in range(2)]
    for _ in range(2):
        span = [rng.randrange(256) for _ in range(rng.randint(6, 16))]
        filler = [rng.randrange(256) for _ in range(rng.randint(0, 8))]
        prompts.append(span + filler + span + filler + span[: rng.randint(2, len(span))])
    return prompts


@pytest.fixture(scope="module", params=TOY_ARCHITECTURES)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def models(arch):
    return {std: toy_model(toy_config(arch), init_std=std, seed=7) for std in (0.02, 0.5)}


TOTALS: dict[str, GenerationMetrics] = {}


@pytest.mark.parametrize("std", [0.02, 0.5])
@pytest.mark.parametrize("match", ["first", "recent"])
def test_ngram_equals_greedy(arch, models, std, match):
    model = models[std]
    target = TransformersTarget(model)
    for i, prompt in enumerate(make_prompts(zlib.crc32(f"{arch}{std}{match}".encode()))):
        eos = None if i % 2 == 0 else 256
        expected = hf_greedy(model, prompt, NEW_TOKENS, eos)
        drafter = NgramDrafter(max_ngram=4, min_ngram=1 + i % 2, max_draft=3 + i, match=match)
        dec = SpeculativeDecoder(
            target, drafter, max_draft=3 + i, eos_token_ids=[] if eos is None else [eos], adaptive=False
        )
        result = dec.generate(prompt, NEW_TOKENS)
        assert result.token_ids == expected, f"{arch} std={std} prompt {i}"
    if std == 0.02:
        assert result.metrics.accepted_tokens > 0, "a looping model should accept some n-gram drafts"


def test_oracle_drafts_full_partial_rejected_and_eos(arch, models):
    """Drafts with corruptions on real models: every acceptance shape, EOS inside a draft, short budgets."""
    model = models[0.5]
    rec = RecordingTarget(TransformersTarget(model))
    shapes = {"full": 0, "partial": 0, "rejected": 0}
    stopped_at_eos = 0
    for i, prompt in enumerate(make_prompts(42)):
        reference = prompt + hf_greedy(model, prompt, NEW_TOKENS + 8, None)
        # Choose an EOS that the model really emits mid-way, so it can land inside a draft.
        eos = reference[len(prompt) + 10 + i] if i % 2 else None
        budget = NEW_TOKENS if i < 3 else 7
        expected = hf_greedy(model, prompt, budget, eos)
        drafter = OracleDrafter(reference, vocab=VOCAB, corrupt=0.25, seed=i)
        dec = SpeculativeDecoder(rec, drafter, max_draft=5, eos_token_ids=[] if eos is None else [eos], adaptive=False)
        rec.forwards.clear()
        rec.rollbacks.clear()
        result = dec.generate(prompt, budget)
        assert result.token_ids == expected, f"{arch} prompt {i}"
        assert len(result.token_ids) <= budget
        if eos is not None and len(expected) < budget:
            stopped_at_eos += 1
            assert result.stop_reason == "eos"
        for (start, fed), kept in zip(rec.forwards[1:], rec.rollbacks, strict=True):
            drafted, accepted = len(fed) - 1, kept - start - 1
            if drafted:
                key = "full" if accepted == drafted else "rejected" if accepted == 0 else "partial"
                shapes[key] += 1
    assert all(shapes.values()), shapes
    assert stopped_at_eos > 0


def test_cache_length_after_each_round(arch, models):
    """After each round the cache holds prompt + emitted tokens minus the pending one, both when the first draft
    is verified inside the prefill forward (plain target) and when it is not (recording wrapper)."""
    model = models[0.02]
    prompt = make_prompts(3)[2]
    runs = {}
    for fused in (True, False):
        # Fusing the first draft into the prefill scores it as a prompt row: only without decode matching.
        target = TransformersTarget(model, decode_matched=not fused)
        rec = None if fused else RecordingTarget(target)
        dec = SpeculativeDecoder(
            rec or target, NgramDrafter(max_ngram=3, min_ngram=1, max_draft=4), max_draft=4, adaptive=False
        )
        emitted, chunks = 0, []
        gen = dec.start(prompt, NEW_TOKENS)
        for chunk in gen:
            emitted += len(chunk)
            chunks.append(chunk)
            # Every emitted token but the pending last one is in the cache (of the generation's sequence).
            assert gen.sequence is not None
            seq = gen.sequence if rec is None else rec.inner_sequence(gen.sequence)
            if gen.stop_reason:  # the last round: the sequence was released as the generation stopped
                assert seq.cache is None
                continue
            assert gen.sequence.length == seq.length == len(prompt) + emitted - 1
            assert seq.cache.get_seq_length() == len(prompt) + emitted - 1
        assert emitted == NEW_TOKENS
        runs[fused] = ([t for c in chunks for t in c], gen.metrics)
        if not fused:
            assert len(chunks[0]) == 1
            assert len(rec.rollbacks) == gen.metrics.target_forwards
    (fused_ids, fused_m), (plain_ids, plain_m) = runs[True], runs[False]
    assert fused_ids == plain_ids
    # The prefill forward verified a draft: one more drafted round, no more target forwards.
    assert fused_m.drafts >= 1 and fused_m.target_forwards <= plain_m.target_forwards
    assert fused_m.drafted_tokens > plain_m.drafted_tokens or fused_m.target_forwards < plain_m.target_forwards
