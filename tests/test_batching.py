"""Continuous batching: several sequences in one forward, each request bitwise what it is alone.

The batched forward (`LeanTarget.forward_batch`) must give every sequence's rows exactly the logits of its own
forward; a `Batch` of generations (any drafter, greedy or seeded, chains or trees, joining and leaving at any step,
cancelled or not) must emit for each exactly what plain decoding of it alone emits; targets that cannot batch run
each sequence's round in turn behind the same interface.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lattice_inference import Generator
from lattice_inference.batching import Batch
from lattice_inference.decode import SpeculativeDecoder
from lattice_inference.draft_planner import DraftPlanner
from lattice_inference.drafters.ngram import NgramDrafter
from lattice_inference.errors import ConfigError, TokenError
from lattice_inference.sampling import SamplingOptions
from lattice_inference.targets import make_target
from lattice_inference.targets.base import Segment
from lattice_inference.targets.exactness import check_exactness
from lattice_inference.targets.facts import ForwardCosts
from lattice_inference.targets.lean import LeanTarget
from lattice_testing.toy import TOY_VOCAB, byte_tokenizer, toy_config, toy_model

from .helpers import FLAT_COSTS, OracleDrafter, TreeOracleDrafter

ARCHES = ("llama", "qwen3", "qwen2")
EOS = 256


def _model(arch: str, dtype: torch.dtype = torch.float32, seed: int = 3):
    return toy_model(toy_config(arch), init_std=0.4, seed=seed).to(dtype)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(2, 40))] for _ in range(count)]


CACHES = [(torch.float32, "model"), (torch.bfloat16, "model"), (torch.float32, "float16")]
"""(activations, ``kv_cache``): the model's dtype in its cache, and float32 activations over a float16 cache."""


@pytest.mark.parametrize(("dtype", "kv_cache"), CACHES)
@pytest.mark.parametrize("arch", ARCHES)
def test_batched_rows_equal_each_sequence_alone(arch, dtype, kv_cache):
    target = LeanTarget(_model(arch, dtype), kv_cache=kv_cache)
    assert target.batches_sequences
    assert target.kv_dtype == (torch.float16 if kv_cache == "float16" else dtype)
    rng = random.Random(arch)
    contexts = _prompts(4, seed=len(arch))
    steps = [[rng.randrange(256) for _ in range(w)] for w in (1, 5, 2, 4)]
    trees = [None, None, None, [-1, 0, 0, 1]]
    for round_ in range(2):  # a second step over the kept rows of the first
        alone = []
        for context, tokens, parents in zip(contexts, steps, trees, strict=True):
            single = target.new_sequence(owner=None)  # computed alone: no rows reused from any other sequence
            target.prefill(single, context)
            if parents is None:
                alone.append(target.forward(single, tokens))
            else:
                alone.append(target.forward_tree(single, tokens, parents))
            target.release(single)
        if round_ == 0:
            sequences = [target.new_sequence() for _ in contexts]
            for sequence, context in zip(sequences, contexts, strict=True):
                target.prefill(sequence, context)
        outputs = target.forward_batch([Segment(s, t, p) for s, t, p in zip(sequences, steps, trees, strict=True)])
        for i, (output, want) in enumerate(zip(outputs, alone, strict=True)):
            assert torch.equal(output.logits, want), (arch, dtype, round_, i)
        for sequence, context, tokens in zip(sequences, contexts, steps, strict=True):
            assert sequence.length == len(context) + len(tokens)
            assert sequence.cache.layers[0].keys.dtype == target.kv_dtype
            target.keep_rows(sequence, len(context), [0])  # keep the first row: the next step continues from it
            context.append(tokens[0])
    for sequence in sequences:
        target.release(sequence)
    assert all(sequence.released for sequence in sequences)


def test_a_failed_batched_forward_leaves_every_sequence_as_it_was():
    target = LeanTarget(_model("llama"))
    first, second = target.new_sequence(), target.new_sequence()
    for sequence in (first, second):
        target.prefill(sequence, [1, 2, 3])
    with pytest.raises(TokenError, match="outside the vocabulary"):
        target.forward_batch([Segment(first, [4, 5]), Segment(second, [TOY_VOCAB + 5])])
    for sequence in (first, second):
        assert sequence.length == 3
    other = LeanTarget(_model("llama"))
    with pytest.raises(ValueError, match="another target"):
        other.forward(first, [4])
    assert first.length == 3
    target.release(first)
    with pytest.raises(ValueError, match="released"):
        target.forward(first, [4])


@pytest.mark.parametrize("kv_cache", ["model", "float16"])
def test_the_self_check_covers_batched_rows(kv_cache):
    exactness = check_exactness(LeanTarget(_model("qwen3"), kv_cache=kv_cache), 6)
    assert exactness.exact and exactness.batched == 3
    assert "3 sequences in one forward" in exactness.line()
    assert ("float16 KV cache" in exactness.line()) == (kv_cache == "float16")


def _run_batch(decoders, prompts, budgets, samplings, *, joins, max_batch, cancel=None, taken_in=None):
    """Run every prompt in one `Batch`: prompt ``i`` joins at step ``joins[i]`` (or when a place frees up) with
    ``decoders[i]``; ``cancel`` maps prompt index -> step at which it is removed. Returns the generations; the
    indexes of those whose prompts were taken in by chunks are added to ``taken_in``."""
    target = decoders[0].target
    batch = Batch(target)
    gens = [d.new_generation(p, n, s) for d, p, n, s in zip(decoders, prompts, budgets, samplings, strict=True)]
    waiting = list(range(len(prompts)))
    step = 0
    while waiting or len(batch):
        for i in list(waiting):
            if joins[i] <= step and len(batch) < max_batch:
                waiting.remove(i)
                batch.add(decoders[i], gens[i])
                if gens[i].prompt_left and taken_in is not None:
                    taken_in.add(i)
        for i, at in (cancel or {}).items():
            if at == step:
                batch.remove(gens[i])
        batch.step()
        step += 1
        assert step < 500
    assert all(gen.sequence is not None and gen.sequence.released for gen in gens)  # the batch holds none
    return gens, batch


def _oracle_decoders(plain, target, prompts, budgets, samplings, *, max_draft):
    """Plain decoding's answers to the prompts, and per prompt a decoder on ``target`` drafting from a corrupted
    oracle of them (drafts fully accepted, partly, rejected at once), which knows the EOS plain decoding emits."""
    triples = list(zip(prompts, budgets, samplings, strict=True))
    want = [plain.generate(p, n, s).token_ids for p, n, s in triples]
    free = [plain.generate(p, n + 4, s).token_ids for p, n, s in triples]  # past the budget: a real EOS
    decoders = []
    for i, prompt in enumerate(prompts):
        drafter = OracleDrafter(prompt + free[i], vocab=TOY_VOCAB, corrupt=0.3, seed=i)
        decoders.append(SpeculativeDecoder(target, drafter, max_draft=max_draft, eos_token_ids=[EOS], adaptive=False))
    return want, decoders


SAMPLINGS = [
    SamplingOptions(),
    SamplingOptions(temperature=0.9, seed=5),
    SamplingOptions(temperature=0.7, top_p=0.9, seed=11, repetition_penalty=1.2),
]


@pytest.mark.parametrize(("dtype", "kv_cache"), CACHES)
@pytest.mark.parametrize("arch", ARCHES)
def test_a_batch_emits_for_each_generation_what_plain_decoding_of_it_alone_emits(arch, dtype, kv_cache):
    """Corrupted-oracle drafts (fully accepted, partly, rejected at once), EOS, budgets of 1, greedy and seeded."""
    model = _model(arch, dtype)
    target = LeanTarget(model, kv_cache=kv_cache)
    plain = SpeculativeDecoder(target, None, eos_token_ids=[EOS])
    prompts = _prompts(7, seed=len(arch))
    samplings = [SAMPLINGS[i % 3] for i in range(len(prompts))]
    budgets = [24, 1, 30, 12, 24, 18, 28]
    want, decoders = _oracle_decoders(plain, target, prompts, budgets, samplings, max_draft=5)
    gens, batch = _run_batch(decoders, prompts, budgets, samplings, joins=[0, 0, 0, 2, 3, 5, 9], max_batch=3)
    for i, gen in enumerate(gens):
        assert gen.token_ids == want[i], (arch, dtype, i)
    assert batch.batched_rows > 0
    drafted = sum(g.metrics.drafted_tokens for g in gens)
    accepted = sum(g.metrics.accepted_tokens for g in gens)
    assert 0 < accepted < drafted


@pytest.mark.parametrize(("dtype", "kv_cache"), CACHES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_long_prompts_taken_in_by_chunks_leave_every_answer_as_alone(arch, dtype, kv_cache, monkeypatch):
    """Prompts longer than a chunk join by chunks that share steps with the others' rounds (several at once,
    arriving mid-stream, one stopping at its first token, one reusing a kept prefix): each answer, greedy and
    seeded, is token for token plain decoding's of it alone."""
    from lattice_inference import batching

    monkeypatch.setattr(batching, "PROMPT_CHUNK", 5)
    monkeypatch.setattr(batching, "PROMPT_CHUNK_MAX", 9)
    target = LeanTarget(_model(arch, dtype), kv_cache=kv_cache)
    plain = SpeculativeDecoder(
        LeanTarget(target.model, kv_cache=kv_cache, prefix_cache=False), None, eos_token_ids=[EOS]
    )
    rng = random.Random(arch)
    document = [rng.randrange(256) for _ in range(50)]
    prompts = [
        [rng.randrange(256) for _ in range(4)],
        [rng.randrange(256) for _ in range(5)],
        [*document, 1, 2, 3],
        [rng.randrange(256) for _ in range(33)],
        [*document, 4, 5],  # the document's rows kept from the third prompt
        [rng.randrange(256) for _ in range(21)],
    ]
    samplings = [SAMPLINGS[i % 3] for i in range(len(prompts))]
    budgets = [30, 20, 16, 1, 12, 18]
    want, decoders = _oracle_decoders(plain, target, prompts, budgets, samplings, max_draft=4)
    taken_in: set[int] = set()
    gens, _ = _run_batch(
        decoders, prompts, budgets, samplings, joins=[0, 0, 1, 1, 40, 41], max_batch=4, taken_in=taken_in
    )
    for i, gen in enumerate(gens):
        assert gen.token_ids == want[i], (arch, dtype, i)
    assert taken_in == {2, 3, 5}  # the fifth found 50 of its 52 rows kept: the rest fit one prefill
    assert gens[4].metrics.cached_prompt_tokens == len(document)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_draft_trees_in_a_batch(arch):
    model = _model(arch)
    target = LeanTarget(model)
    plain = SpeculativeDecoder(target, None)
    prompts = _prompts(4, seed=41)
    want = [plain.generate(p, 20).token_ids for p in prompts]
    decoders = [
        SpeculativeDecoder(
            target, TreeOracleDrafter(p + w, TOY_VOCAB, seed=i), max_draft=4, costs=FLAT_COSTS, adaptive=True
        )
        for i, (p, w) in enumerate(zip(prompts, want, strict=True))
    ]
    gens, _ = _run_batch(decoders, prompts, [20] * 4, [SamplingOptions()] * 4, joins=[0, 0, 1, 1], max_batch=4)
    assert [g.token_ids for g in gens] == want
    assert sum(g.metrics.leaves for g in gens) > 0


@pytest.mark.parametrize("forward", ["transformers", "bundled"])
def test_targets_that_do_not_batch_run_each_round_in_turn(forward):
    if forward == "bundled":
        generator = Generator.from_pretrained("bundled", dtype="float32", method="ngram", costs=FLAT_COSTS)
        prompts: list = ["The cat sat on the mat. The cat", "One two three one two", "Hello hello hello"]
    else:
        model = _model("llama")
        target = make_target(model, forward="transformers")
        generator = Generator(model, byte_tokenizer(), method="ngram", target=target, costs=FLAT_COSTS)
        prompts = _prompts(3, seed=5)
    assert not generator.decoder.target.batches_sequences
    alone = [generator.generate(p, 16, temperature=0.8, seed=3).token_ids for p in prompts]
    many = generator.generate_many(prompts, 16, max_batch=2, temperature=0.8, seed=3)
    assert [r.token_ids for r in many] == alone


@pytest.fixture(scope="module")
def ngram_setup():
    model = _model("qwen3", seed=9)
    target = LeanTarget(model)
    prompts = [p * 3 for p in _prompts(5, seed=17)]  # repeats: n-gram drafts get accepted
    plain = SpeculativeDecoder(target, None)
    alone = [plain.generate(p, 20, SAMPLINGS[i % 2]).token_ids for i, p in enumerate(prompts)]
    return target, prompts, alone


@settings(max_examples=12, deadline=None)
@given(
    joins=st.lists(st.integers(0, 8), min_size=5, max_size=5),
    cancelled=st.dictionaries(st.integers(0, 4), st.integers(0, 10), max_size=2),
    max_batch=st.integers(1, 5),
)
def test_any_arrivals_and_cancellations_leave_every_answer_as_alone(ngram_setup, joins, cancelled, max_batch):
    target, prompts, alone = ngram_setup
    decoders = [
        SpeculativeDecoder(target, NgramDrafter(max_ngram=3, min_ngram=1), max_draft=4, adaptive=False) for _ in prompts
    ]
    samplings = [SAMPLINGS[i % 2] for i in range(len(prompts))]
    gens, _ = _run_batch(decoders, prompts, [20] * 5, samplings, joins=joins, max_batch=max_batch, cancel=cancelled)
    for i, gen in enumerate(gens):
        if i in cancelled:
            assert gen.token_ids == alone[i][: len(gen.token_ids)]
        else:
            assert gen.token_ids == alone[i], i


def test_the_planner_drafts_less_as_the_step_fills():
    steep = ForwardCosts((1, 2, 4, 8, 16, 32, 64), (1.0, 1.02, 1.05, 1.2, 1.6, 2.6, 5.0))
    planner = DraftPlanner(steep)
    for _ in range(40):
        planner.record([1] * 8, 8, 6, 1)
    alone = planner.choose(8)
    lengths = []
    for rows in (0, 8, 24, 40, 60):
        planner.share(rows)
        lengths.append(planner.choose(8))
    assert lengths[0] == alone > 0  # nothing shared: the plan made alone
    assert lengths == sorted(lengths, reverse=True) and lengths[-1] == 0


def test_generate_many_checks_its_arguments_first():
    generator = Generator(_model("llama"), byte_tokenizer(), method="ngram")
    for bad in (0, 65, True):
        with pytest.raises(ConfigError, match=r"max_batch must be 1\.\.64"):
            generator.generate_many(["a"], 4, max_batch=bad)
    with pytest.raises(TokenError, match="empty"):
        generator.generate_many(["hello", []], 4)
    assert generator.generate_many([], 4) == []
    results = generator.generate_many(["hello there", "hi"], 6)
    assert [r.text for r in results] == [generator.generate(p, 6).text for p in ("hello there", "hi")]


def test_the_driver_runs_each_targets_generations_in_its_own_batch_as_alone(monkeypatch):
    """The one admit-then-step loop (`Driver`, which `generate_many` and the server's scheduler drive): generations
    of two targets run side by side, at most ``max_batch`` at once, each emitting what it emits alone; an error in
    one batch's step ends that batch's generations only."""
    from lattice_inference.batching import Driver

    decoders = [
        SpeculativeDecoder(make_target(_model(arch)), NgramDrafter(), costs=FLAT_COSTS) for arch in ("llama", "qwen3")
    ]
    prompts = _prompts(6, seed=11)
    alone = [decoders[i % 2].generate(p, 12).token_ids for i, p in enumerate(prompts)]
    driver = Driver(3)
    with pytest.raises(ConfigError, match="max_batch"):
        Driver(0)
    gens = [decoders[i % 2].new_generation(p, 12) for i, p in enumerate(prompts)]
    waiting, most = list(enumerate(gens)), 0
    while waiting or len(driver):
        while waiting and driver.has_room:
            i, gen = waiting.pop(0)
            gen.token_ids.clear()
            driver.admit(decoders[i % 2], gen)
        most = max(most, len(driver))
        assert all(not isinstance(outcome, Exception) for _, outcome in driver.step())
    assert most == 3 and [g.token_ids for g in gens] == alone
    assert len({id(driver.batch_for(d.target)) for d in decoders}) == 2

    broken = [decoders[i % 2].new_generation(p, 12) for i, p in enumerate(prompts[:2])]
    for i, gen in enumerate(broken):
        driver.admit(decoders[i % 2], gen)
    failing = driver.batch_for(decoders[0].target)

    def fail() -> dict:
        failing.close()
        raise RuntimeError("a forward failed")

    monkeypatch.setattr(failing, "step", fail)
    outcomes = {id(batch): outcome for batch, outcome in driver.step()}
    assert isinstance(outcomes[id(failing)], RuntimeError) and len(failing) == 0
    assert not isinstance(outcomes[id(driver.batch_for(decoders[1].target))], Exception)
    driver.close()
    assert len(driver) == 0
