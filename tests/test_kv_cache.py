"""`GrowableLayer` behaves exactly like transformers' ``DynamicLayer`` under appends and crops."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from lattice_inference.targets import TransformersTarget
from lattice_inference.targets.kv_cache import MIN_CAPACITY, GrowableLayer
from lattice_testing.toy import toy_config, toy_model


def test_matches_dynamic_layer_under_random_appends_and_crops():
    rng = random.Random(0)
    ours, ref = GrowableLayer(), DynamicLayer()
    for _ in range(200):
        if rng.random() < 0.7 or ref.get_seq_length() == 0:
            n = rng.choice([1, 1, 3, 17, 300])
            k, v = torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 4)
            got, want = ours.update(k, v), ref.update(k, v)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        else:
            drop = rng.randint(0, ref.get_seq_length())
            ours.crop(-drop)
            ref.crop(-drop)
        assert ours.get_seq_length() == ref.get_seq_length()
        assert ours.get_mask_sizes(1) == ref.get_mask_sizes(1)
    assert ours._k.shape[-2] >= MIN_CAPACITY


def test_crop_errors_and_reset():
    layer = GrowableLayer()
    layer.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    with pytest.raises(ValueError, match="negative count"):
        layer.crop(2)
    with pytest.raises(ValueError, match="cannot remove 4 tokens from a cache of 3"):
        layer.crop(-4)
    layer.reset()
    assert layer.get_seq_length() == 0


def test_targets_use_it_for_full_attention_only():
    target = TransformersTarget(toy_model(toy_config("gemma2")))
    seq = target.new_sequence()
    target.prefill(seq, [1, 2, 3])
    kinds = {type(layer).__name__ for layer in seq.cache.layers}
    assert kinds == {"GrowableLayer", "DynamicSlidingWindowLayer"}


def test_buffers_reach_past_the_length_zeroed_or_stale_and_grow():
    layer = GrowableLayer()
    k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    layer.update(k, v)
    keys, values = layer.buffers(MIN_CAPACITY)
    assert keys.shape == (1, 2, MIN_CAPACITY, 4) and torch.equal(keys[:, :, :5], k)
    assert not keys[:, :, 5:].any() and not values[:, :, 5:].any()  # zeroed: finite past the length
    layer.crop(-2)  # rolled back: the dropped rows stay in the buffer, stale but finite
    assert torch.equal(layer.buffers(5)[0], k) and layer.get_seq_length() == 3
    keys, _ = layer.buffers(MIN_CAPACITY + 1)  # grows, keeping the filled rows and the view of them
    assert keys.shape[-2] == MIN_CAPACITY + 1 and torch.equal(keys[:, :, :3], k[:, :, :3])
    assert torch.equal(layer.keys, k[:, :, :3]) and not keys[:, :, 3:].any()
