"""Our bfloat16 products (``csrc/tile_linear.cpp``) that packed linears run on CPUs with AMX or AVX512-BF16.

For each kernel this CPU runs (AMX tiles and the AVX512-BF16 dot products on an AMX CPU, the latter alone on
AVX512-BF16 CPUs without AMX such as AMD Zen 4): against a float64 product (within bfloat16 rounding of the
float32 sums), each row of a k-row product equal to that row computed alone, bitwise, at widths within one tile,
across tiles, with a padded last tile and across the dot kernel's row chunks and input slices; the weight layout
`pack_weight` picks; clear errors. Skipped where neither runs (AVX2-only CPUs, or the native ops are off): there
bfloat16 products run on oneDNN, which `tests/test_packed_linear.py` covers.
"""

from __future__ import annotations

import pytest
import torch

from lattice_inference.kernels import native_ops
from lattice_inference.kernels.packed_linear import pack_weight, packed_linear, tile_packed


def _kernels() -> list[str]:
    built = native_ops.tiles()
    if built is None:
        return []
    return ["amx", "avx512_bf16"] if built.tile_linear_kernel() == "amx" else [built.tile_linear_kernel()]


@pytest.fixture(scope="module", params=_kernels() or ["none"])
def tiles(request):
    """The built extension, running the kernel named by the parameter (AMX CPUs: each in turn)."""
    built = native_ops.tiles()
    if built is None:
        why = native_ops.unavailable() or "no AVX512-BF16 or AMX, or LATTICE_TILES=0"
        pytest.skip(f"our bfloat16 products do not run here ({why})")
    built.prefer_amx(request.param == "amx")
    assert built.tile_linear_kernel() == request.param
    yield built
    built.prefer_amx(True)


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize(("out", "inp"), [(48, 64), (96, 1536), (208, 96)])
def test_products_are_the_float64_product_rounded(tiles, out, inp):
    weight, bias, x = _rand(out, inp, seed=1), _rand(out, seed=2), _rand(1, 21, inp, seed=3)
    packed = pack_weight(weight)
    assert tile_packed(packed)
    y = packed_linear(x, packed, bias)
    want = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    assert y.shape == (1, 21, out) and y.dtype == torch.bfloat16
    # float32 sums (at most ~inp * 2^-24 relative each step) then one bfloat16 rounding (2^-9 relative)
    error = (y.double() - want).abs()
    assert bool((error <= want.abs() * 2**-8 + 1e-3 * want.abs().max()).all()), float(error.max())


def test_rows_equal_one_row_products_at_every_width(tiles):
    weight, bias = _rand(160, 576, seed=4), _rand(160, seed=5)
    packed = pack_weight(weight)
    x = _rand(40, 576, seed=6)
    alone = torch.cat([packed_linear(x[i : i + 1], packed, bias) for i in range(40)])
    for width in (2, 3, 4, 5, 7, 15, 16, 17, 33, 40):  # within a tile/row chunk, full ones, a padded last tile
        assert torch.equal(packed_linear(x[:width], packed, bias), alone[:width]), width
    assert torch.equal(packed_linear(x[7:12], packed, None), packed_linear(x, packed, None)[7:12])


def test_pack_weight_uses_the_tiles_only_where_they_take_the_weight(tiles):
    assert tile_packed(pack_weight(_rand(32, 64)))
    assert not tile_packed(pack_weight(_rand(40, 64)))  # outputs not a multiple of 16: oneDNN
    assert not tile_packed(pack_weight(_rand(32, 48)))  # inputs not a multiple of 32: oneDNN
    assert not tile_packed(pack_weight(torch.randn(32, 64)))  # float32: not the tiles (oneDNN or `rows_linear`)


def test_tiles_can_be_turned_off(tiles, monkeypatch):
    monkeypatch.setenv("LATTICE_TILES", "0")
    assert native_ops.tiles() is None
    assert not tile_packed(pack_weight(_rand(32, 64)))


def test_bad_input_gets_a_clear_error(tiles):
    packed = pack_weight(_rand(32, 64))
    with pytest.raises(RuntimeError, match="input of 63 features, the weight takes 64"):
        tiles.tile_linear(_rand(2, 63), packed, None)
    with pytest.raises(RuntimeError, match="bfloat16 input expected"):
        tiles.tile_linear(torch.randn(2, 64), packed, None)
    with pytest.raises(RuntimeError, match="a bfloat16 bias of 32 values"):
        tiles.tile_linear(_rand(2, 64), packed, _rand(31))
    with pytest.raises(RuntimeError, match=r"\[out, in\] = \[40, 64\], out must be a multiple of 16"):
        tiles.tile_pack(_rand(40, 64))


@pytest.mark.parametrize("on", [True, False])
def test_a_bfloat16_lean_target_runs_its_layers_on_the_tiles_or_on_onednn(tiles, on, monkeypatch):
    """With our products (the default here) and without them (``LATTICE_TILES=0 LATTICE_ROWS=0``: oneDNN), a
    bfloat16 lean target's k-token rows equal its 1-token steps."""
    from lattice_inference.targets.lean import LeanTarget
    from lattice_testing.toy import toy_config, toy_model

    if not on:
        monkeypatch.setenv("LATTICE_TILES", "0")
        monkeypatch.setenv("LATTICE_ROWS", "0")
    model = toy_model(toy_config("qwen3", hidden_size=128, intermediate_size=1536, head_dim=32), seed=1)
    lean = LeanTarget(model.to(torch.bfloat16))
    assert lean._loop is not None
    assert all(tile_packed(packed) == on for packed in lean._loop.parts)
    seq = lean.new_sequence()
    lean.prefill(seq, list(range(20)))
    wide = lean.forward(seq, [5, 6, 7])
    lean.rollback(seq, 20)
    assert all(torch.equal(lean.forward(seq, [token])[0], wide[i]) for i, token in enumerate([5, 6, 7]))
