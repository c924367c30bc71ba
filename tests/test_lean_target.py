"""The lean forward (`LeanTarget`): the model's own computation on every path.

Llama, Qwen2 and Qwen3 toys (a 1536-wide MLP, float32 and bfloat16): prefill, 1-token steps, chains with and
without decode matching, draft trees and kept paths, rollback to every position, hidden states for MTP. Without
decode matching and in every prefill its logits are the model forward's bit for bit; with it, a layer's row-wise
work runs in the native ops (`native_ops`) or, without them, attention in fixed-shape float32 blocks
(`block_attention`), so its logits agree with the model's to rounding and its own k-token rows equal its 1-token
steps bitwise. Greedy and sampled decoding through it equal transformers'
``generate`` (float32); `make_target` picks it where it applies and says why not where asked for it elsewhere.
"""

from __future__ import annotations

import random

import pytest
import torch

from lattice_inference import Generator
from lattice_inference.errors import ConfigError
from lattice_inference.kernels import native_ops
from lattice_inference.options import DecodeOptions
from lattice_inference.sampling import SamplingOptions
from lattice_inference.targets import LeanTarget, TransformersTarget, make_target
from lattice_testing.toy import byte_tokenizer, toy_config, toy_model

from .helpers import hf_generate, hf_sampled

LEAN_ARCHES = ["llama", "qwen2", "qwen3"]
SHAPES = dict(hidden_size=128, intermediate_size=1536, head_dim=32)


def _model(arch: str, dtype: torch.dtype = torch.float32, seed: int = 1):
    return toy_model(toy_config(arch, **SHAPES), init_std=0.3, seed=seed).to(dtype)


@pytest.mark.parametrize(("matched", "native"), [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", LEAN_ARCHES)
def test_every_path_gives_the_models_own_logits(arch, dtype, matched, native):
    model = _model(arch, dtype)
    lean = LeanTarget(model, decode_matched=matched, native=native)
    plain = TransformersTarget(model, decode_matched=matched)
    assert lean.native == (native and native_ops.ops() is not None)
    ls, ps = lean.new_sequence(capture_hidden=True), plain.new_sequence(capture_hidden=True)
    prefilled = _close(dtype) if lean.native else torch.equal  # the native ops prefill too
    same = _close(dtype) if matched else prefilled  # unmatched rows after a native prefill: over its cache
    rng = random.Random(arch)
    context = [rng.randrange(256) for _ in range(60)]
    assert prefilled(lean.prefill(ls, context), plain.prefill(ps, context))
    assert prefilled(ls.hidden, ps.hidden)
    for tokens in ([5], [6, 7, 8], [9] * 6, [10]):
        assert same(lean.forward(ls, tokens), plain.forward(ps, tokens)), tokens
        assert same(ls.hidden, ps.hidden)
    for length in range(len(context) + 11, len(context) - 1, -3):  # rollback to many positions, then continue
        lean.rollback(ls, length)
        plain.rollback(ps, length)
        assert same(lean.forward(ls, [3, 4]), plain.forward(ps, [3, 4])), length
    start = ls.length
    tokens, parents = [1, 2, 3, 4, 5, 6], [-1, 0, 1, 0, 3, 1]
    assert same(lean.forward_tree(ls, tokens, parents), plain.forward_tree(ps, tokens, parents))
    lean.keep_rows(ls, start, [0, 3, 4])
    plain.keep_rows(ps, start, [0, 3, 4])
    assert same(lean.forward(ls, [7, 8]), plain.forward(ps, [7, 8]))
    fused_lean, fused_plain = LeanTarget(model, decode_matched=False), TransformersTarget(model, decode_matched=False)
    fused_same = _close(dtype) if fused_lean.native else torch.equal
    assert fused_same(
        fused_lean.prefill_with_draft(fused_lean.new_sequence(), context, [1, 2, 3]),
        fused_plain.prefill_with_draft(fused_plain.new_sequence(), context, [1, 2, 3]),
    )


def test_a_prompt_in_chunks_equals_it_whole():
    """The native prefill computes each row as every later forward does, at any length: a prompt taken in as three
    chunks (a prefill, then two forwards) leaves logits and cache rows equal bitwise to one prefill of it whole."""
    model = _model("llama", torch.bfloat16)
    lean = LeanTarget(model)
    if not lean.native:
        pytest.skip(f"the native ops do not run here: {native_ops.unavailable()}")
    context = list(range(3, 63))
    whole, chunked = lean.new_sequence(), lean.new_sequence("other")
    logits = lean.prefill(whole, context)
    lean.prefill(chunked, context[:17])
    lean.forward(chunked, context[17:40])
    last = lean.forward(chunked, context[40:])
    assert torch.equal(logits, last[-1])
    for mine, theirs in zip(lean.cache_of(whole).layers, lean.cache_of(chunked).layers, strict=True):
        assert torch.equal(mine.keys[..., : len(context), :], theirs.keys[..., : len(context), :])


@pytest.mark.parametrize("path", ["native loop", "native ops", "unmatched"])
def test_a_float16_cache_on_every_path(path):
    """``kv_cache="float16"``: every path writes float16 rows (the native layer loop, the native ops layer by layer,
    transformers' ``sdpa`` call for rows without decode matching) and reads them widened; the logits stay within
    float16 rounding of the float32 cache's, and matched k-token rows equal 1-token steps bitwise."""
    model = _model("qwen3")
    matched = path != "unmatched"
    half = LeanTarget(model, kv_cache="float16", decode_matched=matched)
    wide = LeanTarget(model, decode_matched=matched)
    assert (half.kv_dtype, wide.kv_dtype, half.kv_cache, wide.kv_cache) == (torch.float16, torch.float32, "float16", "")
    if path == "native ops":
        half._loop = wide._loop = None

    def near(a: torch.Tensor, b: torch.Tensor) -> bool:  # float16 keys and values: about 3 decimal digits
        return 0 < float((a - b).abs().max()) <= 2e-2 * float(b.abs().max())

    rng = random.Random(path)
    context = [rng.randrange(256) for _ in range(40)]
    hs, ws = half.new_sequence(), wide.new_sequence()
    assert near(half.prefill(hs, context), wide.prefill(ws, context))
    assert hs.cache.layers[0].keys.dtype == torch.float16
    for tokens in ([5], [6, 7, 8], [9] * 5):
        start = hs.length
        rows = half.forward(hs, tokens)
        assert near(rows, wide.forward(ws, tokens))
        if matched:
            half.rollback(hs, start)
            for i, token in enumerate(tokens):
                assert torch.equal(half.forward(hs, [token])[0], rows[i]), (tokens, i)


def test_kv_cache_float16_is_refused_where_it_cannot_run():
    model = _model("llama")
    assert LeanTarget(model).kv_dtype == torch.float32  # auto: a dense float32 model keeps its dtype
    with pytest.raises(
        ConfigError, match=r"float32 activations and the native ops; this model runs in torch\.bfloat16"
    ):
        LeanTarget(_model("llama", torch.bfloat16), kv_cache="float16")
    with pytest.raises(ConfigError, match="the native ops do not run here"):
        LeanTarget(model, native=False, kv_cache="float16")
    with pytest.raises(ConfigError, match="kv_cache float16 needs the lean forward's native ops; this model runs on"):
        make_target(model, forward="transformers", kv_cache="float16")
    with pytest.raises(ConfigError, match="kv_cache must be one of auto, model, float16, got 'int8'"):
        DecodeOptions(kv_cache="int8")
    generator = Generator(model, byte_tokenizer(), DecodeOptions(kv_cache="float16"))
    assert generator.decoder.target.kv_cache == "float16"


def _close(dtype: torch.dtype):
    """Agreement to the rounding of a different attention kernel: relative to the largest logit."""
    tolerance = 1e-4 if dtype == torch.float32 else 6e-2

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool((a.float() - b.float()).abs().max() <= tolerance * b.float().abs().max())

    return close


@pytest.mark.parametrize("path", ["native loop", "native ops", "pytorch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", LEAN_ARCHES)
def test_matched_rows_equal_its_own_one_token_steps(arch, dtype, path):
    """Chains of every width at contexts crossing block boundaries, a tree, after rollbacks: bitwise, through
    the native layer loop, the native ops called layer by layer from Python, and the PyTorch path
    (`block_attention`)."""
    lean = LeanTarget(_model(arch, dtype), native=path != "pytorch")
    if path == "native ops":
        lean._loop = None  # the Python loop over the same ops: where products are not one packed matrix each
    seq = lean.new_sequence(capture_hidden=True)
    rng = random.Random(arch)
    lean.prefill(seq, [rng.randrange(256) for _ in range(29)])
    for width in (2, 3, 5, 8, 11, 16):
        start, tokens = seq.length, [rng.randrange(256) for _ in range(width)]
        wide, hidden = lean.forward(seq, tokens), seq.hidden
        lean.rollback(seq, start)
        for i, token in enumerate(tokens):
            assert torch.equal(lean.forward(seq, [token])[0], wide[i]), (width, i)
            assert torch.equal(seq.hidden[0], hidden[i]), (width, i)
        lean.rollback(seq, start + rng.randrange(width + 1))  # keep some, as an accepted prefix would


@pytest.mark.parametrize("arch", LEAN_ARCHES)
def test_greedy_and_sampling_through_it_equal_transformers_generate(arch):
    model = _model(arch, seed=4)
    tokenizer = byte_tokenizer()
    rng = random.Random(len(arch))
    for method in ("greedy", "ngram"):
        gen = Generator(model, tokenizer, method=method, min_ngram=1, eos_token_ids=[256])
        assert isinstance(gen.decoder.target, LeanTarget)
        for i in range(3):
            span = [rng.randrange(256) for _ in range(8)]
            prompt = [rng.randrange(256) for _ in range(20)] + span + span[:3]
            assert gen.generate(prompt, 24).token_ids == hf_generate(model, prompt, 24, 256), (method, i)
            options = SamplingOptions(temperature=0.8, top_k=40, seed=i)
            want = hf_sampled(model, prompt, 24, 256, options)
            assert gen.generate(prompt, 24, **options.to_dict()).token_ids == want, (method, i, "sampled")


def test_make_target_picks_the_lean_forward_where_it_applies():
    assert isinstance(make_target(_model("llama")), LeanTarget)
    assert type(make_target(_model("llama"), forward="transformers")) is TransformersTarget
    assert type(make_target(toy_model(toy_config("mistral")))) is TransformersTarget  # sliding windows
    with pytest.raises(ConfigError, match="lean forward cannot run this model: model type 'gemma'"):
        make_target(toy_model(toy_config("gemma")), forward="lean")
    with pytest.raises(ConfigError, match="forward must be one of auto, lean, transformers"):
        DecodeOptions(forward="fast")
