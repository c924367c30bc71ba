"""Repetition, presence and frequency penalties: their definitions, and losslessness under speculation.

The definitions are checked against transformers' ``RepetitionPenaltyLogitsProcessor`` and a small reference
of OpenAI's formulas, row by row and over whole generations (plain decoding equals transformers' ``generate``
with those processors, greedy and keyed sampling). Speculation is checked against plain decoding with the same
settings: n-gram and corrupted-oracle chains (full, partial and rejected rounds), the hybrid model's ``ngram``,
``mtp`` and ``ngram+mtp`` (draft trees: `test_draft_tree`); log-probabilities stay the raw logits'.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from lattice_inference import Generator, SamplingOptions
from lattice_inference.decode import SpeculativeDecoder
from lattice_inference.drafters.ngram import NgramDrafter
from lattice_inference.errors import ConfigError
from lattice_inference.mtp import load_mtp_head
from lattice_inference.penalties import Penalties, row_paths
from lattice_inference.targets import TransformersTarget
from lattice_testing.toy import TOY_VOCAB, toy_config, toy_model

from .helpers import FLAT_COSTS, OpenAIPenaltyProcessor, OracleDrafter, RecordingTarget, hf_generate, hf_plain
from .test_hybrid_methods import prompts, write_model

NEW = 24
#: Penalty settings: discouraging and (negative, below 1) encouraging repeats, alone and together.
PENALTIES = [
    dict(repetition_penalty=1.3),
    dict(presence_penalty=0.8, frequency_penalty=0.5),
    dict(repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=1.5),
    dict(presence_penalty=-0.6, frequency_penalty=-0.4),
    dict(repetition_penalty=0.8),
]
SAMPLING = [dict(), dict(temperature=0.8, seed=3), dict(temperature=1.2, top_k=40, top_p=0.9, seed=4)]


def options_for(i: int) -> SamplingOptions:
    """Setting ``i``: the penalties cycle against greedy and two samplings, so every pair comes up."""
    return SamplingOptions(**PENALTIES[i % len(PENALTIES)], **SAMPLING[i % len(SAMPLING)])


def reference_row(row: torch.Tensor, prompt: list[int], history: list[int], options: SamplingOptions) -> torch.Tensor:
    """One row penalised the slow way: transformers' processor over prompt + history, then OpenAI's formulas with
    counts over the history (the generated tokens) only."""
    ids = torch.tensor([prompt + history])
    x = RepetitionPenaltyLogitsProcessor(options.repetition_penalty)(ids, row[None].clone())
    return OpenAIPenaltyProcessor(len(prompt), options.presence_penalty, options.frequency_penalty)(ids, x)[0]


@pytest.mark.parametrize("i", range(len(PENALTIES)))
def test_each_tree_row_is_penalised_by_its_own_path(i):
    options = options_for(i)
    vocab, prompt, generated = 40, [3, 5, 5, 9, 30], [5, 7, 7, 12, 3]
    tokens, parents = [12, 20, 21, 7, 22, 20, 33], [-1, 0, 1, 2, 0, 4, 1]  # a chain of 3 and two side branches
    logits = torch.randn(len(tokens), vocab, generator=torch.Generator().manual_seed(i)) * 3
    logits[:, 4] = float("-inf")
    penalties = Penalties(options, prompt)
    penalties.extend(generated[:2])
    penalties.extend(generated[2:])
    got = penalties.apply(logits, tokens, parents)
    assert row_paths(tokens, parents) == [[], [20], [20, 21], [20, 21, 7], [22], [22, 20], [20, 33]]
    for r, path in enumerate(row_paths(tokens, parents)):
        assert torch.equal(got[r], reference_row(logits[r], prompt, generated + path, options)), r
    assert not torch.equal(got, logits) and torch.isneginf(got[:, 4]).all()
    chain = penalties.apply(logits[:4], tokens[:4])  # parents=None: a chain
    assert torch.equal(chain, got[:4])


def test_the_formulas_on_numbers():
    """OpenAI's definitions over generated tokens only, transformers' over the prompt too, spelled out."""
    logits = torch.tensor([[2.0, -2.0, 1.0, 4.0]])
    openai = Penalties(SamplingOptions(presence_penalty=0.5, frequency_penalty=0.25), prompt_ids=[2])
    openai.extend([0, 0, 1])
    assert openai.apply(logits, [1]).tolist() == [[2.0 - 0.5 - 0.5, -2.0 - 0.25 - 0.5, 1.0, 4.0]]
    repetition = Penalties(SamplingOptions(repetition_penalty=2.0), prompt_ids=[2])
    repetition.extend([1])
    assert repetition.apply(logits, [1]).tolist() == [[2.0, -4.0, 0.5, 4.0]]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", float("nan")),
        ("presence_penalty", True),
    ],
)
def test_bad_penalties_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        SamplingOptions(**{field: value})


def test_neutral_penalties_are_off():
    assert not SamplingOptions(repetition_penalty=1, presence_penalty=-0.0, frequency_penalty=0).penalised
    assert SamplingOptions(frequency_penalty=0.1).penalties() == {"frequency_penalty": 0.1}


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma2"])
def test_plain_equals_transformers_and_speculation_equals_plain(arch):
    """Plain decoding with penalties is transformers' ``generate`` with the processors; n-gram and corrupted-oracle
    chains emit it token for token, EOS included."""
    model = toy_model(toy_config(arch), init_std=0.5, seed=7)
    target = RecordingTarget(TransformersTarget(model))
    shapes: Counter[str] = Counter()
    changed = eos_stops = 0
    for i, prompt in enumerate(prompts(10, len(arch))):
        opts = options_for(i)
        free = hf_plain(model, prompt, NEW + 6, None, opts)
        eos = free[10 + i % 5] if i % 2 else None
        want = hf_plain(model, prompt, NEW, eos, opts)
        changed += want != hf_plain(model, prompt, NEW, eos, SamplingOptions(**SAMPLING[i % len(SAMPLING)]))
        eos_ids = [] if eos is None else [eos]
        plain = SpeculativeDecoder(TransformersTarget(model), eos_token_ids=eos_ids, adaptive=False, max_draft=4)
        assert plain.generate(prompt, NEW, opts).token_ids == want, (arch, i, "plain")
        ngram = SpeculativeDecoder(
            TransformersTarget(model),
            NgramDrafter(max_ngram=3, min_ngram=1),
            max_draft=4,
            eos_token_ids=eos_ids,
            adaptive=False,
        )
        assert ngram.generate(prompt, NEW, opts).token_ids == want, (arch, i, "ngram")
        oracle = OracleDrafter(prompt + free, vocab=TOY_VOCAB, corrupt=0.25, seed=i)
        target.clear()
        got = SpeculativeDecoder(target, oracle, max_draft=5, eos_token_ids=eos_ids, adaptive=False).generate(
            prompt, NEW, opts
        )
        assert got.token_ids == want, (arch, i, "oracle")
        eos_stops += got.stop_reason == "eos"
        shapes += target.round_shapes()
    assert all(shapes[k] for k in ("full", "partial", "rejected")), shapes
    assert changed >= 6 and eos_stops > 0  # most settings change the text


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return write_model(
        tmp_path_factory.mktemp("hybrid-penalties") / "moe", init_std=0.05, head="echo", seed=5, moe=True
    )


def test_hybrid_every_method_equals_plain(hybrid):
    """``ngram``, ``mtp`` (coupled and argmax drafting) and ``ngram+mtp``: the head's drafts are only proposals."""
    plain = Generator.from_pretrained(str(hybrid), dtype="float32", method="greedy")
    head = load_mtp_head(str(hybrid), dtype=torch.float32, draft_length=3)
    common = dict(mtp_head=head, min_ngram=1, draft_length=3)
    generators = {
        "ngram": Generator(plain.model, plain.tokenizer, method="ngram", costs=FLAT_COSTS, **common),
        # fixed drafts: the accepted count below must not depend on which rounds the planner finds paying
        "mtp": Generator(plain.model, plain.tokenizer, method="mtp", adaptive=False, **common),
        "mtp-argmax": Generator(plain.model, plain.tokenizer, method="mtp", coupled_draft=False, **common),
        "ngram+mtp": Generator(plain.model, plain.tokenizer, method="ngram+mtp", **common),
    }
    accepted = dict.fromkeys(generators, 0)
    for i, prompt in enumerate(prompts(6, 21)):
        opts = options_for(i)
        want = hf_plain(plain.model, prompt, NEW, 256, opts)
        assert plain.generate(prompt, NEW, **opts.to_dict()).token_ids == want, (i, "plain")
        for name, gen in generators.items():
            got = gen.generate(prompt, NEW, **opts.to_dict())
            assert got.token_ids == want, (i, name)
            accepted[name] += got.metrics.accepted_tokens
    assert accepted["ngram"] > 0 and accepted["mtp"] > 0, accepted


def test_logprobs_are_the_raw_logits(hybrid):
    """With penalties on, each token's log-probability is the raw log-softmax at its index (as vLLM's default),
    the same with speculation as without."""
    plain = Generator.from_pretrained(str(hybrid), dtype="float32", method="greedy")
    # fixed drafts: the planner may decline to draft on a busy machine, and this test needs drafted tokens
    ngram = Generator(plain.model, plain.tokenizer, method="ngram", min_ngram=1, adaptive=False)
    opts = SamplingOptions(repetition_penalty=0.8, frequency_penalty=0.3)
    accepted = 0
    for prompt in prompts(3, 5):
        want = plain.generate(prompt, NEW, logprobs=2, **opts.to_dict())
        got = ngram.generate(prompt, NEW, logprobs=2, **opts.to_dict())
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
        accepted += got.metrics.accepted_tokens
        with torch.no_grad():
            logits = plain.model(torch.tensor([prompt + want.token_ids])).logits[0, len(prompt) - 1 : -1]
        raw = torch.log_softmax(logits.float(), dim=-1)
        assert [lp.logprob for lp in want.logprobs] == pytest.approx(
            [float(raw[i, t]) for i, t in enumerate(want.token_ids)], abs=1e-4
        )
    assert accepted > 0
    assert want.token_ids != hf_generate(plain.model, prompt, NEW, 256)  # the penalties changed the text
