"""Decode-matched verification: every row of a k-token forward is, bit for bit, the 1-token step's, in every dtype.

Kernel by kernel (row-planned products at the model's shapes and awkward ones, per-row attention over chains,
trees and sliding windows), target by target (toy architectures with wide shapes and a 320-token context, the
Gated DeltaNet hybrids, dense and MoE), and end to end: in bfloat16 and float16, speculative output (n-gram,
oracle drafts fully / partly / not accepted and hitting EOS, draft trees, keyed sampling) equals plain decoding
through the same target. The self-check catches a product whose rows drift with the row count. (Without decode
matching, the row checks here failed on the CPUs this ran on; that is a fact of those kernels, not asserted.)
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lattice_inference import Generator
from lattice_inference.api import mtp_head_for
from lattice_inference.cpu_features import has_native_bf16
from lattice_inference.decode import SpeculativeDecoder
from lattice_inference.drafters.ngram import NgramDrafter
from lattice_inference.kernels import decode_matched
from lattice_inference.kernels.decode_matched import (
    CALIBRATED_ROWS,
    decode_matched_sdpa,
    linear_key,
    matched_product,
    matching,
)
from lattice_inference.kernels.packed_linear import pack_weight, packed_linear, packing_supported
from lattice_inference.models.load import load_model
from lattice_inference.sampling import SamplingOptions
from lattice_inference.targets import make_target
from lattice_inference.targets.exactness import check_exactness, exactness
from lattice_inference.targets.facts import ForwardCosts
from lattice_testing.toy import TOY_VOCAB, toy_config, toy_model

from .helpers import OracleDrafter, TreeOracleDrafter
from .test_hybrid_methods import tiny_config

DTYPES = [torch.bfloat16, torch.float32, torch.float16]
WIDE = dict(hidden_size=256, intermediate_size=1536, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
"""Toy shapes with a down projection over K = 1536, where oneDNN's 1-row kernel splits its reduction."""
ARCHES = ["qwen3", "llama", "qwen2", "mistral", "phi3"]
FLAT = ForwardCosts((1, 64), (1.0, 1.0))


def _kernels(dtype: torch.dtype, weight: torch.Tensor) -> dict[str, object]:
    kernels = {"dense": lambda x: torch.nn.functional.linear(x, weight)}
    if packing_supported(dtype):
        packed = pack_weight(weight)
        kernels["packed"] = lambda x: packed_linear(x, packed)
    return kernels


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(576, 1536), (1024, 2048), (256, 4096), (960, 576), (3000, 576), (7, 1536)])
def test_planned_products_give_each_row_the_one_row_result(dtype, shape):
    """Rows of an M-row product (M = 1..20, past the calibrated 16) equal 1-row products, bitwise."""
    gen = torch.Generator().manual_seed(sum(shape))
    weight = (torch.randn(shape, generator=gen) * 0.05).to(dtype)
    x = torch.randn(1, 20, shape[1], generator=gen).to(dtype)
    for kind, kernel in _kernels(dtype, weight).items():
        key = linear_key(kind, weight, None)
        with matching():
            alone = torch.cat([matched_product(key, kernel, x[:, i : i + 1]) for i in range(20)], dim=1)
            for m in range(1, 21):
                rows = matched_product(key, kernel, x[:, :m])
                assert rows.shape == (1, m, shape[0])
                assert torch.equal(rows, alone[:, :m]), (kind, dtype, shape, m)
        assert torch.equal(matched_product(key, kernel, x), kernel(x)), "outside a matched forward: the kernel as is"


def test_rows_past_the_calibrated_width_run_in_blocks():
    weight = torch.randn(64, 1536)
    x = torch.randn(CALIBRATED_ROWS * 2 + 3, 1536)
    with matching():
        out = matched_product(linear_key("dense", weight, None), lambda t: torch.nn.functional.linear(t, weight), x)
    assert torch.allclose(out, x @ weight.T, atol=1e-4)


class _Attention(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cached", [5, 300, 700])
def test_attention_rows_are_one_token_calls(dtype, cached):
    """A chain's rows (causal mask) and a tree's rows (ancestor mask) equal 1-row calls over their own keys."""
    gen = torch.Generator().manual_seed(cached)
    module = _Attention()
    m = 12
    q = torch.randn(1, 9, m, 64, generator=gen).to(dtype)
    k = torch.randn(1, 3, cached + m, 64, generator=gen).to(dtype)
    v = torch.randn(1, 3, cached + m, 64, generator=gen).to(dtype)
    causal = torch.ones(m, cached + m, dtype=torch.bool).tril(cached)[None, None]
    with matching():
        out, _ = decode_matched_sdpa(module, q, k, v, causal, scaling=0.125)
    for i in range(m):
        want, _ = sdpa_attention_forward(
            module, q[:, :, i : i + 1], k[:, :, : cached + i + 1], v[:, :, : cached + i + 1], None, scaling=0.125
        )
        assert torch.equal(out[:, i : i + 1], want), i
    parents = [-1, 0, 1, 0, 3, 1]
    allowed = torch.zeros(len(parents), cached + len(parents), dtype=torch.bool)
    allowed[:, :cached] = True
    for i, p in enumerate(parents):
        if p >= 0:
            allowed[i] = allowed[p]
        allowed[i, cached + i] = True
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
    n = len(parents)
    with matching():
        out, _ = decode_matched_sdpa(
            module, q[:, :, :n], k[:, :, : cached + n], v[:, :, : cached + n], mask, scaling=0.125
        )
    for i in range(n):
        cols = allowed[i].nonzero().squeeze(-1)
        want, _ = sdpa_attention_forward(module, q[:, :, i : i + 1], k[:, :, cols], v[:, :, cols], None, scaling=0.125)
        assert torch.equal(out[:, i : i + 1], want), ("tree", i)


def _rows_match(target, context: list[int], tokens: list[int]) -> bool:
    seq = target.new_sequence()
    target.prefill(seq, context)
    alone = [target.forward(seq, [t])[-1].clone() for t in tokens]
    target.rollback(seq, len(context))
    for w in range(2, len(tokens) + 1):
        wide = target.forward(seq, tokens[:w])
        target.rollback(seq, len(context))
        if not all(torch.equal(wide[i], alone[i]) for i in range(w)):
            return False
    return True


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHES)
def test_wide_toys_verify_rows_as_one_token_steps(arch, dtype):
    """After a 320-token context, forwards of 2..12 tokens equal 1-token steps row for row, and the self-check
    agrees."""
    model = toy_model(toy_config(arch, **WIDE), init_std=0.3, seed=3).to(dtype)
    rng = random.Random(arch)
    context = [rng.randrange(256) for _ in range(320)]
    tokens = [rng.randrange(256) for _ in range(12)]
    assert _rows_match(make_target(model), context, tokens), (arch, dtype)
    report = check_exactness(make_target(model), 12)
    assert report.exact, report.failures
    assert report.trees == (arch != "mistral")  # sliding windows verify chains only


@pytest.mark.parametrize("forward", ["transformers", "lean"])
def test_the_self_check_reports_a_broken_identity_and_where(monkeypatch, forward):
    """A product whose multi-row results drift by 1e-3 (as a row-count-dependent kernel would) is caught: the
    report says NOT exact, at width 2, and names the first module whose rows differ."""
    model = toy_model(toy_config("llama", **WIDE), init_std=0.3, seed=3)
    original = decode_matched.RowPlan.apply

    def drifting(self, kernel, x):
        out = original(self, kernel, x)
        return out + 1e-3 if x.reshape(-1, x.shape[-1]).shape[0] > 1 else out

    monkeypatch.setattr(decode_matched.RowPlan, "apply", drifting)
    report = check_exactness(make_target(model, forward=forward), 6)
    assert not report.exact and report.failures[0].startswith("width 2, row 0")
    assert "NOT exact" in report.line()
    if forward == "transformers":  # the lean loop runs its products without module calls: the next module is named
        assert "Linear (model.layers.0.self_attn.q_proj)" in report.failures[0]


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_hybrid_rows_are_one_token_steps(moe, dtype):
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(tiny_config(300, moe=moe), dtype=torch.float32).eval().to(dtype)
    rng = random.Random(int(moe))
    context = [rng.randrange(256) for _ in range(40)]
    tokens = [rng.randrange(256) for _ in range(10)]
    assert _rows_match(make_target(model), context, tokens)
    assert _rows_match(make_target(model), context[:2], tokens)  # a conv history still shorter than the kernel
    assert check_exactness(make_target(model), 10).exact


def _plain(target, prompt, new, eos, sampling=None):
    return (
        SpeculativeDecoder(target, None, eos_token_ids=eos, adaptive=False, max_draft=4)
        .generate(prompt, new, sampling)
        .token_ids
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "mistral"])
def test_low_precision_speculation_equals_plain_decoding(arch, dtype):
    """n-gram (fixed and adaptive), oracle drafts of every acceptance shape with EOS, draft trees, and keyed
    sampling emit plain decoding's tokens through the same bfloat16 / float16 target."""
    model = toy_model(toy_config(arch, **WIDE), init_std=0.3, seed=11).to(dtype)
    target = make_target(model)
    rng = random.Random(f"{arch}{dtype}")
    eos_stops = leaves = accepted = rejected = 0
    for i in range(4):
        span = [rng.randrange(256) for _ in range(12)]
        prompt = [rng.randrange(256) for _ in range(rng.randint(150, 250))] + span + span[:4]
        free = _plain(target, prompt, 40, [])
        eos = [free[25]] if i % 2 else []
        want = _plain(target, prompt, 32, eos)
        for adaptive in (False, True):
            drafter = NgramDrafter(max_ngram=4, min_ngram=1, max_draft=8)
            dec = SpeculativeDecoder(target, drafter, max_draft=8, eos_token_ids=eos, adaptive=adaptive, costs=FLAT)
            out = dec.generate(prompt, 32)
            assert out.token_ids == want, (arch, i, "ngram", adaptive)
            assert out.metrics.exact is True
        oracle = SpeculativeDecoder(
            target, OracleDrafter(prompt + free, TOY_VOCAB, 0.3, seed=i), max_draft=6, eos_token_ids=eos, adaptive=False
        )
        got = oracle.generate(prompt, 32)
        assert got.token_ids == want, (arch, i, "oracle")
        eos_stops += got.stop_reason == "eos"
        accepted += got.metrics.accepted_tokens
        rejected += got.metrics.drafted_tokens - got.metrics.accepted_tokens
        tree = SpeculativeDecoder(
            target,
            TreeOracleDrafter(prompt + free, TOY_VOCAB, seed=i),
            max_draft=4,
            eos_token_ids=eos,
            adaptive=True,
            costs=FLAT,
        )
        got = tree.generate(prompt, 32)
        assert got.token_ids == want, (arch, i, "tree")
        leaves += got.metrics.accepted_leaves
        options = SamplingOptions(temperature=0.9, top_p=0.95, seed=100 + i)
        sampled = _plain(target, prompt, 32, eos, options)
        drafter = NgramDrafter(max_ngram=4, min_ngram=1, max_draft=8)
        got = SpeculativeDecoder(target, drafter, max_draft=8, eos_token_ids=eos, adaptive=False).generate(
            prompt, 32, options
        )
        assert got.token_ids == sampled, (arch, i, "sampled")
    assert eos_stops > 0 and accepted > 0 and rejected > 0
    assert arch == "mistral" or leaves > 0


def test_prepare_takes_the_check_and_calibration_off_the_first_generation():
    model = toy_model(toy_config("qwen3", **WIDE), init_std=0.3, seed=2).to(torch.bfloat16)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    lazy = SpeculativeDecoder(make_target(model), NgramDrafter(min_ngram=1), max_draft=6, adaptive=True)
    first = lazy.generate(prompt, 16)
    assert first.metrics.calibration_s > 0 and first.metrics.exact is True
    eager = SpeculativeDecoder(make_target(model), NgramDrafter(min_ngram=1), max_draft=6, adaptive=True)
    assert eager.exactness is None
    assert eager.prepare() > 0 and eager.exactness is not None and eager.exactness.widths == tuple(range(2, 8))
    got = eager.generate(prompt, 16)
    assert got.metrics.calibration_s < first.metrics.calibration_s / 10 and got.metrics.exact is True
    assert got.token_ids == first.token_ids
    assert eager.prepare() < first.metrics.calibration_s / 10  # kept per target
    assert "exact" in got.metrics.to_dict() and got.metrics.to_dict()["exact"] is True


def test_bundled_hybrid_mtp_sampling_in_bfloat16_is_the_same_text_at_any_draft_width():
    """The bundled Qwen3.5-hybrid demonstration model and its MTP head in bfloat16: seeded sampling and greedy give
    plain decoding's tokens whether the planner picks the widths (which depend on timings, as a server's streamed
    and whole requests did) or every round verifies the whole draft."""
    loaded = load_model("bundled", dtype="bfloat16")
    plain = Generator(loaded.model, loaded.tokenizer, method="greedy", eos_token_ids=loaded.eos_token_ids)
    common = dict(mtp_head=mtp_head_for(loaded, 4), draft_length=4, eos_token_ids=loaded.eos_token_ids)
    planned = Generator(plain.model, plain.tokenizer, method="mtp", **common)
    fixed = Generator(plain.model, plain.tokenizer, method="mtp", adaptive=False, **common)
    texts = ["def fib(n):\n    if n < 2:\n        return n\n", "The history of the city", "x = [1, 2, 3]\n"]
    native = has_native_bf16()  # emulated bfloat16 costs several times more a forward: fewer, shorter there
    new = 40 if native else 24
    accepted = 0
    for i, text in enumerate(texts if native else texts[:2]):
        ids = plain.encode(text)
        for sampling in ({}, {"temperature": 0.9, "top_p": 0.95, "seed": 7 + i}):
            want = plain.generate(ids, new, **sampling).token_ids
            for gen in (planned, fixed):
                got = gen.generate(ids, new, **sampling)
                assert got.token_ids == want, (text, sampling, gen.options.adaptive)
                assert got.metrics.exact is True
                accepted += got.metrics.accepted_tokens
    assert accepted > 0


def test_the_self_check_is_kept_per_target_and_widened_when_asked():
    target = make_target(toy_model(toy_config("llama"), init_std=0.3, seed=9))
    assert exactness(target, 1).widths == ()
    assert exactness(target, 4).widths == (2, 3, 4)
    assert exactness(target, 3) is exactness(target, 4)  # covered: not run again


@pytest.mark.parametrize("forward", ["lean", "transformers"])
def test_the_self_check_costs_and_row_plans_live_on_their_target(forward):
    """What one target checked and measured stays on it (`Target.facts`): a second target over another copy of
    the model starts with none of it, and each keeps its own after both have run."""
    from lattice_inference.targets.forward_cost import forward_costs

    model = toy_model(toy_config("llama"), seed=0)
    first = make_target(model, forward=forward)
    other = make_target(toy_model(toy_config("llama"), seed=0).to(torch.bfloat16), forward=forward)
    report = exactness(first, 4)
    assert first.facts.exactness is report and exactness(first, 4) is report  # checked once, then kept
    assert first.facts.row_plans and other.facts.exactness is None and not other.facts.row_plans
    costs = forward_costs(first, 4)
    assert first.facts.costs is costs and other.facts.costs is None
    assert exactness(other, 4).exact
    dtypes = {key[-3] for key in other.facts.row_plans}
    assert dtypes == {torch.bfloat16} and {key[-3] for key in first.facts.row_plans} == {torch.float32}


def test_our_own_kernels_are_planned_without_calibration(monkeypatch):
    """Our product kernels (`ROW_EXACT_KINDS`: tiles, rows, every quantized format) are row-exact by construction
    and planned at base 1 at once (calibrating a 1.5B model's output layer cost its first decode step 4.8 s);
    oneDNN's and dense products are still calibrated."""
    from lattice_inference.kernels import decode_matched

    def fail(*args, **kwargs):
        raise AssertionError("calibrated")

    monkeypatch.setattr(decode_matched, "calibrate", fail)
    plans: dict = {}
    x = torch.randn(1, 8)
    for kind in ("tiles", "rows", "quant-Q4_K", "quant-Q5_0+Q5_0+Q8_0"):
        assert decode_matched.plan_for((kind, (4, 8), False), lambda r: r, x, plans) == decode_matched.RowPlan(1)
    calls = []
    monkeypatch.setattr(decode_matched, "calibrate", lambda *a: calls.append(a) or decode_matched.RowPlan(4))
    for kind in ("packed", "dense"):
        assert decode_matched.plan_for((kind, (4, 8), False), lambda r: r, x, plans) == decode_matched.RowPlan(4)
    assert len(calls) == 2
