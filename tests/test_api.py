"""The Python API (`Generator`) on real toy models, and the target factory's choices."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from lattice_inference import ConfigError, Generator, TokenError, UnsupportedModelError
from lattice_inference.targets import HybridTarget, TransformersTarget, make_target
from lattice_inference.targets.facts import ForwardCosts
from lattice_testing.toy import byte_tokenizer, toy_config, toy_model

TEXT = "alpha beta gamma delta\nalpha beta gamma delta\nalpha beta"


@pytest.fixture(scope="module")
def model():
    return toy_model(toy_config("llama"), init_std=0.02, seed=3)


def test_generate_and_stream_equal_greedy(model):
    tok = byte_tokenizer()
    greedy = Generator(model, tok, method="greedy").generate(TEXT, max_new_tokens=30)
    gen = Generator(model, tok, method="ngram", max_draft=6, min_ngram=1, adaptive=False)
    out = gen.generate(TEXT, max_new_tokens=30)
    assert out.token_ids == greedy.token_ids
    assert out.text == greedy.text == tok.decode(greedy.token_ids, skip_special_tokens=True)
    streamed = gen.start(TEXT, max_new_tokens=30)
    assert "".join(gen.text_stream(streamed)) == out.text
    assert streamed.metrics.target_forwards < greedy.metrics.target_forwards


def test_given_costs_decide_the_plans_on_every_cpu(model):
    """``costs`` stands in for the forward costs the planner would measure on this CPU, and stands as given: flat
    costs draft wherever drafts are accepted, costs growing a step a token never draft, whatever this machine's
    forwards cost; both emit greedy's tokens."""
    tok = byte_tokenizer()
    greedy = Generator(model, tok, method="greedy").generate(TEXT, max_new_tokens=30)
    common = dict(method="ngram", max_draft=6, min_ngram=1)
    flat = Generator(model, tok, costs=ForwardCosts((1, 8), (1.0, 1.0)), **common)
    steep = Generator(model, tok, costs=ForwardCosts((1, 8), (1.0, 8.0)), **common)
    a, b = flat.generate(TEXT, max_new_tokens=30), steep.generate(TEXT, max_new_tokens=30)
    assert a.token_ids == b.token_ids == greedy.token_ids
    assert a.metrics.accepted_tokens > 0 and a.metrics.target_forwards < greedy.metrics.target_forwards
    assert b.metrics.drafted_tokens == 0 and b.metrics.target_forwards == greedy.metrics.target_forwards
    assert flat.decoder.costs is not None and flat.decoder.costs.relative(8) == 1.0


def test_bad_method_and_tokens(model):
    tok = byte_tokenizer()
    with pytest.raises(ConfigError, match="unknown method 'beam'"):
        Generator(model, tok, method="beam")
    gen = Generator(model, tok)
    with pytest.raises(TokenError, match="id 9999, outside the vocabulary of size 259"):
        gen.generate([1, 2, 9999], max_new_tokens=3)
    with pytest.raises(ConfigError, match="min_ngram"):
        Generator(model, tok, min_ngram=4, max_ngram=2)


def tiny_qwen35() -> Qwen3_5ForCausalLM:
    cfg = Qwen3_5TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"],
    )
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(cfg).eval()


def test_factory_routes_hybrids_and_plain_target_refuses_them(model):
    hybrid = tiny_qwen35()
    with pytest.raises(UnsupportedModelError, match="recurrent-state cache layer"):
        TransformersTarget(hybrid)
    assert isinstance(make_target(hybrid), HybridTarget)
    assert isinstance(make_target(model), TransformersTarget)
