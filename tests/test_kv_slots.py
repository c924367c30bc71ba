"""Preallocated cache slots (``kv_slots``): every method emits what it emits over growing caches, alone and in
batches; a sequence's buffers never move; slots are shared with the prefix cache's kept sequences and given back;
what does not fit is refused before anything changes."""

from __future__ import annotations

import pytest
import torch

from lattice_inference import Generator
from lattice_inference.errors import ConfigError, TokenError
from lattice_inference.options import DecodeOptions
from lattice_inference.targets import make_target
from lattice_inference.targets.kv_cache import GrowableLayer
from lattice_testing.toy import byte_tokenizer, toy_config, toy_model

from .helpers import FLAT_COSTS

PROMPTS = [[(5 * i + 3 * j) % 200 for j in range(9 + 3 * i)] * 2 for i in range(5)]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return toy_model(toy_config(request.param), init_std=0.5, seed=11)


@pytest.mark.parametrize("method", ["greedy", "ngram"])
def test_every_method_emits_over_slots_what_it_emits_over_growing_caches(model: torch.nn.Module, method: str) -> None:
    grown = Generator(model, byte_tokenizer(), method=method, costs=FLAT_COSTS)
    slotted = Generator(model, byte_tokenizer(), method=method, costs=FLAT_COSTS, kv_slots=3)
    assert slotted.decoder.target.slots is not None and grown.decoder.target.slots is None
    for sampling in ({}, {"temperature": 0.8, "seed": 4}):
        want = [grown.generate(p, 20, **sampling).token_ids for p in PROMPTS]
        assert [slotted.generate(p, 20, **sampling).token_ids for p in PROMPTS] == want
        many = slotted.generate_many(PROMPTS, 20, max_batch=3, **sampling)
        assert [r.token_ids for r in many] == want


def test_a_sequences_buffers_stay_where_its_slot_is(model: torch.nn.Module) -> None:
    target = make_target(model, kv_slots=2, prefix_cache=False)
    slots = target.slots
    assert slots is not None and slots.count == 2 and slots.rows == model.config.max_position_embeddings
    seq = target.new_sequence()
    target.prefill(seq, PROMPTS[0])
    layers = target.cache_of(seq).layers
    assert all(isinstance(layer, GrowableLayer) for layer in layers)
    where = [layer.buffers(1)[0].data_ptr() for layer in layers]
    pool = [k.data_ptr() for k in slots.keys]
    assert where == pool  # slot 0 of every layer's preallocated keys
    for token in range(40):  # far past a growing cache's first buffer
        target.forward(seq, [token, token + 1])
        target.rollback(seq, seq.length - 1)
    assert [layer.buffers(1)[0].data_ptr() for layer in layers] == where
    assert slots.free == 1


def test_slots_are_shared_with_kept_sequences_and_given_back(model: torch.nn.Module) -> None:
    target = make_target(model, kv_slots=2)
    slots = target.slots
    assert slots is not None
    first, second = target.new_sequence(), target.new_sequence()
    target.prefill(first, PROMPTS[0])
    target.prefill(second, PROMPTS[1])
    assert slots.free == 0
    third = target.new_sequence()
    with pytest.raises(RuntimeError, match="all 2 cache slots"):
        target.prefill(third, PROMPTS[2])
    assert third.cache is None and third.length == 0  # as before its prefill
    target.release(first)  # kept for prefix reuse: it still holds its slot
    assert slots.free == 0
    target.prefill(third, PROMPTS[2])  # the kept one is dropped to free its slot
    assert slots.free == 0 and third.length == len(PROMPTS[2])
    probe = target.new_sequence(None, probe=True)  # the target's own measurements never hold a slot
    target.prefill(probe, PROMPTS[3])
    assert slots.free == 0 and probe.length == len(PROMPTS[3])
    target.release(second)
    target.release(third)
    target.forget_prefix()
    assert slots.free == 2


def test_what_does_not_fit_a_slot_is_refused_before_anything_changes(model: torch.nn.Module) -> None:
    from lattice_inference.targets.lean import LeanTarget

    target = LeanTarget(model, kv_slots=1, slot_rows=32)
    seq = target.new_sequence()
    with pytest.raises(TokenError, match="33 positions do not fit a cache slot of 32"):
        target.prefill(seq, list(range(33)))
    target.prefill(seq, list(range(30)))
    before = target.forward(seq, [7])
    target.rollback(seq, 30)
    with pytest.raises(TokenError, match="do not fit"):
        target.forward(seq, [7, 8, 9])
    assert seq.length == 30
    assert torch.equal(target.forward(seq, [7]), before)


def test_kv_slots_is_checked_and_needs_the_lean_forward(model: torch.nn.Module) -> None:
    with pytest.raises(ConfigError, match="kv_slots must be a number of sequences >= 0"):
        DecodeOptions(kv_slots=-1)
    with pytest.raises(ConfigError, match="kv_slots needs the lean forward"):
        make_target(model, forward="transformers", kv_slots=2)
    two = Generator(model, byte_tokenizer(), method="ngram", kv_slots=2)
    with pytest.raises(ConfigError, match=r"kv_slots \(2\) must be at least max_batch \(3\)"):
        two.generate_many(PROMPTS, 8, max_batch=3)
    assert two.decoder.target.slots is not None and two.decoder.target.slots.free == 2  # nothing was started
