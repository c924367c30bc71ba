"""Lossless sampling: with the same seed, every method emits plain keyed sampling's tokens, token for token.

The reference is transformers' own ``generate`` (its temperature / top-k / top-p / min-p warpers, then the keyed
Gumbel noise, then greedy search), so it checks our processors, our noise indexing and our loop at once. Attention
models of three architectures (one with a sliding window) with n-gram and corrupted-oracle drafts (full, partial
and rejected rounds, EOS inside a draft), and dense and MoE hybrid Qwen3.5 models with ``ngram``, ``mtp`` (coupled
and argmax drafting) and ``ngram+mtp``; temperatures 0.3, 0.7, 1.0 and 1.5 with and without truncation.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from lattice_inference import Generator, SamplingOptions
from lattice_inference.decode import SpeculativeDecoder
from lattice_inference.drafters.ngram import NgramDrafter
from lattice_inference.mtp import load_mtp_head
from lattice_inference.targets import TransformersTarget, make_target
from lattice_testing.toy import TOY_VOCAB, toy_config, toy_model

from .helpers import OracleDrafter, RecordingTarget, hf_sampled
from .test_hybrid_methods import prompts, write_model

SETTINGS = [
    dict(temperature=0.3),
    dict(temperature=0.7, top_k=20),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=1.5, min_p=0.05),
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=40, top_p=0.95, min_p=0.02),
    dict(temperature=1.5),
    dict(temperature=0.3, top_p=0.5),
]
NEW = 20


def options_for(i: int, salt: int) -> SamplingOptions:
    return SamplingOptions(**SETTINGS[i % len(SETTINGS)], seed=1000 * salt + i)


def make_prompts(seed: int, n: int = 8) -> list[list[int]]:
    return prompts(n, seed)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma2"])
def test_attention_models(arch):
    """n-gram and corrupted-oracle drafts on attention models: identical to plain sampling with the seed."""
    model = toy_model(toy_config(arch), init_std=0.3, seed=11)
    target = RecordingTarget(TransformersTarget(model))
    shapes: Counter[str] = Counter()
    eos_stops = 0
    for i, prompt in enumerate(make_prompts(len(arch))):
        opts = options_for(i, len(arch))
        free = hf_sampled(model, prompt, NEW + 6, None, opts)
        eos = free[8 + i] if i % 2 else None  # a token the model really samples mid-way
        want = hf_sampled(model, prompt, NEW, eos, opts)
        eos_ids = [] if eos is None else [eos]
        ngram = SpeculativeDecoder(
            TransformersTarget(model),
            NgramDrafter(max_ngram=3, min_ngram=1),
            max_draft=4,
            eos_token_ids=eos_ids,
            adaptive=False,
        )
        assert ngram.generate(prompt, NEW, opts).token_ids == want, (arch, i, "ngram")
        oracle = OracleDrafter(prompt + free, vocab=TOY_VOCAB, corrupt=0.2, seed=i)
        dec = SpeculativeDecoder(target, oracle, max_draft=5, eos_token_ids=eos_ids, adaptive=False)
        target.clear()
        got = dec.generate(prompt, NEW, opts)
        assert got.token_ids == want, (arch, i, "oracle")
        eos_stops += got.stop_reason == "eos"
        shapes += target.round_shapes()
    assert all(shapes[k] for k in ("full", "partial", "rejected")), shapes
    assert eos_stops > 0


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-sampling")
    return {
        "dense": write_model(root / "dense", init_std=0.3, head="random", seed=4),
        "moe": write_model(root / "moe", init_std=0.05, head="echo", seed=5, moe=True),
    }


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_hybrid_models_every_method(hybrids, kind):
    path = str(hybrids[kind])
    plain = Generator.from_pretrained(path, dtype="float32", method="greedy")
    head = load_mtp_head(path, dtype=torch.float32, draft_length=3)
    common = dict(mtp_head=head, min_ngram=1, draft_length=3)
    generators = {
        "ngram": Generator(plain.model, plain.tokenizer, method="ngram", **common),
        # fixed drafts: the accepted count below must not depend on which rounds the planner finds paying
        "mtp": Generator(plain.model, plain.tokenizer, method="mtp", adaptive=False, **common),
        "ngram+mtp": Generator(plain.model, plain.tokenizer, method="ngram+mtp", **common),
    }
    if kind == "moe":
        generators["mtp-argmax"] = Generator(plain.model, plain.tokenizer, method="mtp", coupled_draft=False, **common)
    oracle_target = make_target(plain.model)
    accepted = dict.fromkeys([*generators, "oracle"], 0)
    rejected = 0
    for i, prompt in enumerate(make_prompts(len(kind) + 7)):
        opts = options_for(i, len(kind) + 7)
        want = hf_sampled(plain.model, prompt, NEW, 256, opts)
        assert plain.generate(prompt, NEW, **opts.to_dict()).token_ids == want, (kind, i, "plain")
        for name, gen in generators.items():
            got = gen.generate(prompt, NEW, **opts.to_dict())
            assert got.token_ids == want, (kind, i, name)
            accepted[name] += got.metrics.accepted_tokens
        oracle = OracleDrafter(prompt + hf_sampled(plain.model, prompt, NEW + 4, None, opts), TOY_VOCAB, 0.2, seed=i)
        got = SpeculativeDecoder(oracle_target, oracle, max_draft=4, eos_token_ids=[256], adaptive=False).generate(
            prompt, NEW, opts
        )
        assert got.token_ids == want, (kind, i, "oracle")
        accepted["oracle"] += got.metrics.accepted_tokens
        rejected += got.metrics.drafted_tokens - got.metrics.accepted_tokens
    assert accepted["oracle"] > 0 and rejected > 0, accepted
    if kind == "moe":  # the echo head drafts what it is fed: some of it is sampled again
        assert accepted["mtp"] > 0, accepted
