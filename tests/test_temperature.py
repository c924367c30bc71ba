"""Temperatures down to the smallest float: no overflow, an exact draw from softmax(logits / T), in every dtype."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lattice_inference import Generator
from lattice_inference.api import mtp_head_for
from lattice_inference.models.load import load_model
from lattice_inference.sampling import KeyedSampler, SamplingOptions, process_logits

from .helpers import hf_warpers

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
#: Positive temperatures across the float64 range: subnormal, float32-subnormal, tiny, ordinary.
TEMPERATURES = st.one_of(
    st.sampled_from([5e-324, 1e-320, 1e-300, 1e-45, 1e-40, 1e-38, 1e-30, 1e-7, 1e-3, 0.5, 2.0]),
    st.floats(min_value=5e-324, max_value=2.0, allow_subnormal=True, exclude_min=False),
)


def exact_probs(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(x / T) in float64, shifted by the row maximum first (no overflow in float64 for float32 inputs)."""
    x = x.double()
    return torch.softmax((x - x.amax(-1, keepdim=True)) / temperature, dim=-1)


@settings(max_examples=300, deadline=None)
@given(
    temperature=TEMPERATURES,
    dtype=st.sampled_from(DTYPES),
    scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]),
    seed=st.integers(0, 2**16),
    ties=st.integers(1, 4),
)
def test_any_positive_temperature_gives_the_exact_processed_distribution(temperature, dtype, scale, seed, ties):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, 40, generator=gen, dtype=torch.float64) * scale).to(dtype)
    x[1, :ties] = x[1].max()  # tied maxima
    out = process_logits(x, SamplingOptions(temperature=temperature))
    assert out.dtype == torch.float32
    assert not out.isnan().any() and not (out == math.inf).any()
    x32 = x.float()
    plain = x32 / temperature
    fits = (torch.isfinite(plain) | ~torch.isfinite(x32)).all(-1)
    for row in range(x.shape[0]):
        if fits[row]:  # no overflow: transformers' warper, bit for bit
            (warper,) = hf_warpers(SamplingOptions(temperature=temperature))
            assert torch.equal(out[row], warper(None, x32[row : row + 1].clone())[0])
        else:  # the exact distribution, which keeps all mass on the maxima as T goes to 0
            got = torch.softmax(out[row].double(), dim=-1)
            assert torch.allclose(got, exact_probs(x32[row], temperature), atol=1e-5, rtol=0)
        top = x32[row] == x32[row].max()
        assert (out[row][top] == out[row].max()).all()  # the argmax set keeps the top value


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_temperatures_draw_uniformly_among_tied_maxima(temperature, dtype):
    x = torch.tensor([[3.0, 7.5, -2.0, 7.5, 7.5, 1.0], [9.0, 1.0, -50.0, 8.9, 0.0, 0.0]], dtype=dtype)
    n = 1500
    draws = [KeyedSampler(SamplingOptions(temperature=temperature, seed=s), 6).choose(x, 11) for s in range(n)]
    assert {d[1] for d in draws} == {0}  # a single maximum: always the argmax
    counts = Counter(d[0] for d in draws)
    assert set(counts) == {1, 3, 4}
    stat = sum((c - n / 3) ** 2 / (n / 3) for c in counts.values())  # chi-square, 2 degrees of freedom
    assert stat < 2 + 8 * math.sqrt(4), counts


@pytest.fixture(scope="module")
def toy():
    return load_model("bundled", dtype="float32")


@pytest.mark.parametrize("temperature", [1e-40, 1e-38, 5e-324])
@pytest.mark.parametrize("method", ["greedy", "ngram", "mtp"])
def test_a_tiny_temperature_generates_the_greedy_text(toy, temperature, method):
    head = mtp_head_for(toy, 4) if method == "mtp" else None
    gen = Generator(toy.model, toy.tokenizer, method=method, mtp_head=head, eos_token_ids=toy.eos_token_ids)
    greedy = Generator(toy.model, toy.tokenizer, method="greedy", eos_token_ids=toy.eos_token_ids)
    want = greedy.generate("Once upon a time", 24).token_ids
    out = gen.generate("Once upon a time", 24, temperature=temperature, seed=1)
    assert out.token_ids == want
    assert np.isfinite(out.metrics.tokens_per_s)
