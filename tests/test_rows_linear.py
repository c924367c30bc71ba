"""Our float32 products (``csrc/rows_linear.cpp``) that packed linears run on CPUs with AVX512F or AVX2 and FMA.

Against a float64 product (within float32 rounding), each row of a k-row product equal to that row computed
alone, bitwise, at widths within one row chunk, across chunks and input slices; the weight layout `pack_weight`
picks; clear errors; a float32 lean target whose layers run on them, its rows reusable by the next prompt; and the
AVX2 build equal to the AVX512 one bit for bit (built here without AVX512 where the CPU has it), so float32 output
does not depend on which of the two a CPU runs. Skipped where neither runs (the native ops off or not built, a
CPU without AVX2): there float32 products run on oneDNN, which `tests/test_packed_linear.py` covers.
"""

from __future__ import annotations

import pytest
import torch

from lattice_inference.cpu_features import isa_ceiling
from lattice_inference.kernels import native_ops
from lattice_inference.kernels.packed_linear import pack_weight, packed_linear, packing_supported, rows_packed


@pytest.fixture(scope="module")
def rows():
    built = native_ops.rows()
    if built is None:
        why = native_ops.unavailable() or "no AVX2 with FMA, or LATTICE_ROWS=0"
        pytest.skip(f"our float32 products do not run here ({why})")
    return built


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("out", "inp"), [(48, 64), (96, 1536), (208, 97)])
def test_products_are_the_float64_product_to_float32_rounding(rows, out, inp):
    weight, bias, x = _rand(out, inp, seed=1), _rand(out, seed=2), _rand(1, 21, inp, seed=3)
    packed = pack_weight(weight)
    assert rows_packed(packed)
    y = packed_linear(x, packed, bias)
    want = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    assert y.shape == (1, 21, out) and y.dtype == torch.float32
    # inp float32 roundings of partial sums of magnitude at most sum |w x|
    bound = (x.double().abs() @ weight.double().abs().T + bias.double().abs()) * inp * 2**-23
    assert bool(((y.double() - want).abs() <= bound).all())


def test_rows_equal_one_row_products_at_every_width(rows):
    weight, bias = _rand(160, 200, seed=4), _rand(160, seed=5)  # 200 inputs: slices of 64 and a short one
    packed = pack_weight(weight)
    x = _rand(40, 200, seed=6)
    alone = torch.cat([packed_linear(x[i : i + 1], packed, bias) for i in range(40)])
    for width in (2, 3, 4, 5, 6, 7, 11, 12, 13, 16, 17, 33, 40):  # within a row chunk, whole ones, a short last one
        assert torch.equal(packed_linear(x[:width], packed, bias), alone[:width]), width
    assert torch.equal(packed_linear(x[7:12], packed, None), packed_linear(x, packed, None)[7:12])


def test_pack_weight_uses_them_only_where_they_take_the_weight(rows, monkeypatch):
    assert rows_packed(pack_weight(_rand(32, 64)))
    assert not rows_packed(pack_weight(_rand(40, 64)))  # outputs not a multiple of 16: oneDNN
    # bfloat16: the tile products where they run, else ours from the bfloat16 bytes
    assert rows_packed(pack_weight(_rand(32, 64).bfloat16())) == (native_ops.tiles() is None)
    monkeypatch.setenv("LATTICE_TILES", "0")
    assert rows_packed(pack_weight(_rand(32, 64).bfloat16()))
    monkeypatch.setenv("LATTICE_ROWS", "0")
    assert native_ops.rows() is None
    assert not rows_packed(pack_weight(_rand(32, 64)))
    if packing_supported(torch.bfloat16):  # oneDNN packs bfloat16 only with AVX512BW/VL/DQ or AVX-NE-CONVERT
        assert not rows_packed(pack_weight(_rand(32, 64).bfloat16()))


def test_bad_input_gets_a_clear_error(rows):
    packed = pack_weight(_rand(32, 64))
    with pytest.raises(RuntimeError, match="input of 63 features, the weight takes 64"):
        rows.rows_linear(_rand(2, 63), packed, None)
    with pytest.raises(RuntimeError, match=r"Float input expected \(the weight's\), got BFloat16"):
        rows.rows_linear(_rand(2, 64).to(torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="a BFloat16 bias of 32 values"):
        rows.rows_linear(_rand(2, 64).bfloat16(), rows.rows_pack(_rand(32, 64).bfloat16()), _rand(32))
    with pytest.raises(RuntimeError, match="a Float bias of 32 values"):
        rows.rows_linear(_rand(2, 64), packed, _rand(31))
    with pytest.raises(RuntimeError, match=r"\[out, in\] = \[40, 64\], out must be a multiple of 16"):
        rows.rows_pack(_rand(40, 64))


@pytest.mark.parametrize(("out", "inp"), [(48, 64), (96, 1536), (208, 97)])
def test_bfloat16_products_are_the_float64_product_to_one_bfloat16_rounding(rows, out, inp):
    """From bfloat16 weights (the path of CPUs without bfloat16 dot products): float32 sums of the exact products,
    rounded once to bfloat16."""
    weight, bias, x = (
        _rand(out, inp, seed=1).bfloat16(),
        _rand(out, seed=2).bfloat16(),
        _rand(21, inp, seed=3).bfloat16(),
    )
    packed = rows.rows_pack(weight)
    assert rows_packed(packed) and packed.dtype == torch.bfloat16
    y = rows.rows_linear(x, packed, bias)
    want = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    assert y.shape == (21, out) and y.dtype == torch.bfloat16
    sums = (x.double().abs() @ weight.double().abs().T + bias.double().abs()) * inp * 2**-23
    bound = want.abs() * 2**-8 + sums * (1 + 2**-8)  # one rounding to 8 bits after the float32 sum's
    assert bool(((y.double() - want).abs() <= bound).all())
    assert torch.equal(y, (x.float() @ weight.float().T + bias.float()).bfloat16()) or inp > 64  # short sums agree


def test_bfloat16_rows_equal_one_row_products_at_every_width(rows):
    weight, bias = _rand(160, 200, seed=4).bfloat16(), _rand(160, seed=5).bfloat16()
    packed = rows.rows_pack(weight)
    x = _rand(40, 200, seed=6).bfloat16()
    alone = torch.cat([rows.rows_linear(x[i : i + 1], packed, bias) for i in range(40)])
    for width in (2, 3, 5, 6, 7, 12, 13, 17, 40):
        assert torch.equal(rows.rows_linear(x[:width], packed, bias), alone[:width]), width


def test_a_bfloat16_lean_target_without_bfloat16_dot_products_runs_its_layers_on_them(rows, monkeypatch):
    """Where no bfloat16 dot-product kernel runs (here: ``LATTICE_TILES=0``; an AVX2-only CPU), a bfloat16 model's
    products run on the row kernel from its bfloat16 bytes: the native layer loop runs, k-token rows equal 1-token
    steps, a prefill's rows are reusable, and speculation equals plain decoding."""
    from lattice_inference.decode import SpeculativeDecoder
    from lattice_inference.drafters.ngram import NgramDrafter
    from lattice_inference.targets.lean import LeanTarget
    from lattice_testing.toy import toy_config, toy_model

    monkeypatch.setenv("LATTICE_TILES", "0")
    model = toy_model(toy_config("qwen3", hidden_size=128, intermediate_size=512, head_dim=32), seed=1).bfloat16()
    lean = LeanTarget(model, prefix_budget=0)
    assert lean._loop is not None and lean._loop.runs(torch.empty(0, dtype=torch.bfloat16))
    seq = lean.new_sequence()
    lean.prefill(seq, list(range(20)))
    wide = lean.forward(seq, [5, 6, 7])
    lean.rollback(seq, 20)
    assert all(torch.equal(lean.forward(seq, [token])[0], wide[i]) for i, token in enumerate([5, 6, 7]))
    lean.prefill(seq, [*range(20), 5, 9])
    assert seq.reused == 21
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4] * 3
    plain = SpeculativeDecoder(lean, None, adaptive=False).generate(prompt, 40).token_ids
    drafter = NgramDrafter(max_ngram=4, min_ngram=1, max_draft=6)
    fast = SpeculativeDecoder(lean, drafter, max_draft=6, adaptive=False).generate(prompt, 40)
    assert fast.token_ids == plain and fast.metrics.drafted_tokens > 0 and fast.metrics.exact is True


@pytest.mark.parametrize("on", [True, False])
def test_a_float32_lean_target_runs_its_layers_on_them_and_its_rows_are_reusable(rows, on, monkeypatch):
    """With our products (the default here) a float32 lean target runs the native layer loop and a prefill's rows
    are reusable; without them (``LATTICE_ROWS=0``: oneDNN) its k-token rows still equal its 1-token steps, and a
    prefill's rows are reused only where the row plans found oneDNN's rows alike at every width (not with AVX-512,
    where its float32 products split their sums by row count; held to AVX2 they may be)."""
    from lattice_inference.targets.lean import LeanTarget
    from lattice_testing.toy import toy_config, toy_model

    if not on:
        monkeypatch.setenv("LATTICE_ROWS", "0")
    model = toy_model(toy_config("qwen3", hidden_size=128, intermediate_size=1536, head_dim=32), seed=1)
    lean = LeanTarget(model, prefix_budget=0)
    runs = lean._loop is not None and lean._loop.runs(torch.empty(0))
    assert runs == on if isa_ceiling() == "avx512" else runs or not on
    seq = lean.new_sequence()
    lean.prefill(seq, list(range(20)))
    wide = lean.forward(seq, [5, 6, 7])
    lean.rollback(seq, 20)
    assert all(torch.equal(lean.forward(seq, [token])[0], wide[i]) for i, token in enumerate([5, 6, 7]))
    lean.prefill(seq, [*range(20), 5, 9])
    assert seq.reused == (21 if runs else 0)


def test_the_avx2_build_equals_the_avx512_build(rows, request):
    """Each output is the same sequence of fused multiply-adds in 8 or 16 lanes: float32 products, and so float32
    output, are the same on AVX2-only CPUs as on AVX512 ones."""
    if rows.rows_linear_kernel() != "avx512":
        pytest.skip("this CPU has no AVX512F: it runs the AVX2 build already")
    avx2 = request.getfixturevalue("other_builds")["avx2"]  # compiled only where the test runs
    assert avx2.rows_linear_kernel() == "avx2"
    for out, inp in [(960, 576), (576, 1536), (48, 40)]:
        weight, bias, x = _rand(out, inp, seed=7), _rand(out, seed=8), _rand(37, inp, seed=9)
        ours = rows.rows_linear(x, rows.rows_pack(weight), bias)
        packed = avx2.rows_pack(weight)
        theirs = avx2.rows_linear(x, packed, bias)
        assert torch.equal(ours, theirs), (out, inp)
        assert all(torch.equal(avx2.rows_linear(x[i : i + 1], packed, bias)[0], theirs[i]) for i in range(37))
        half = (weight.bfloat16(), bias.bfloat16(), x.bfloat16())  # and from bfloat16 weights
        for m in (37, 1, 2, 3):  # up to 2 rows the AVX2 build widens in its own lane order, from 3 into a buffer
            assert torch.equal(
                rows.rows_linear(half[2][:m], rows.rows_pack(half[0]), half[1]),
                avx2.rows_linear(half[2][:m], avx2.rows_pack(half[0]), half[1]),
            ), (out, inp, m)
