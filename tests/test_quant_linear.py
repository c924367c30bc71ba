"""GGUF weights kept quantized (Q8_0, Q4_0, Q4_1) and computed by our products (``quant_linear``).

GGUF's reference (the ``gguf`` package: ``gguf.quants.quantize``/``dequantize``) makes the blocks and says what
they are worth; our dequantization equals it bit for bit. A quantized product is, within float32 rounding, the
float64 product of the dequantized weight with the row's inputs rounded to 8 bits per block of 32 (as llama.cpp
rounds them), and within that rounding of the unrounded product; every row equal bit for bit to that row alone at
widths 1..20 and awkward input sizes; errors name what is wrong; and a quantized toy model (its layers attached by
content, rows permuted as llama's GGUF q/k are) runs the native layer loop, close to its float32 dequantization,
with speculation, draft trees, seeded sampling and batches equal to its plain decoding; and the AVX2 build and the
AVX512 build without VNNI compute the same bits as this one. The real Q4_1 file: ``tests/test_real_model_quantized.py``.
"""

from __future__ import annotations

import pytest
import torch

from lattice_inference.kernels.packed_linear import QUANT, pack_linears, packed_kind, quant_packed
from lattice_inference.kernels.quant_linear import (
    FORMATS,
    concat_packed,
    dequantize,
    pack_reference,
    quant_format,
    quant_pack,
    unpack,
)
from lattice_inference.models.gguf_quantized import attach_tensors, quantized_weights
from lattice_testing.gguf_blocks import quantize

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def ops(quant_ops):
    return quant_ops


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def quantized(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """GGUF blocks of a float32 ``[out, in]`` weight (gguf-py's quantizers where it has one): uint8 ``[out, bytes]``."""
    return quantize(weight, kind)


def _inputs(inp: int, kind: str) -> int:
    """``inp``, times 8 where the format's blocks (256 for the K-quants) do not divide it."""
    return inp if inp % FORMATS[kind].inputs == 0 else inp * 8


@pytest.mark.parametrize("kind", list(FORMATS))
def test_dequantize_is_ggufs_reference_bit_for_bit(kind):
    weight = _rand(48, 512, seed=1) * torch.logspace(-3, 1, 512)  # scales across magnitudes
    weight[3, :32] = 0.0  # an all-zero block
    raw = quantized(weight, kind)
    want = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), getattr(gguf.GGMLQuantizationType, kind)))
    ours = dequantize(raw, kind)
    assert ours.dtype == torch.float32 and ours.shape == weight.shape
    assert torch.equal(ours.view(torch.int32), want.view(torch.int32))


def rounded_inputs(x: torch.Tensor, kind: str = "Q8_0") -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [n, in] rounded to 8 bits as the product rounds it for ``kind``'s weights, as float64, and each
    block's scale: per block of 32 (llama.cpp's Q8_0: the scale ``max|x| / 127``, its inverse, the rounding to
    nearest even, float32 steps), or for the K-quants per block of 256 (Q8_K: ``iscale = -127 / v`` of the first
    input ``v`` of largest magnitude, ``q = min(127, round(iscale * x))``, the scale ``1 / iscale``)."""
    if FORMATS[kind].inputs == 256:
        blocks = x.reshape(x.shape[0], -1, 256)
        top = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # argmax: the first of equal ones
        iscale = torch.where(top != 0, -127.0 / top, torch.zeros_like(top))
        q = torch.round(blocks * iscale).clamp(max=127)
        d = torch.where(top != 0, 1.0 / iscale, torch.zeros_like(top))
    else:
        blocks = x.reshape(x.shape[0], -1, 32)
        d = blocks.abs().amax(-1, keepdim=True) / 127.0
        inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.round(blocks * inverse)
    return (q.double() * d.double()).reshape(x.shape), d.double().abs().expand(blocks.shape).reshape(x.shape)


def _magnitudes(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """Per weight the magnitude the product's float steps round against: ``|w|``, and for the K-quants with mins
    ``|d * scale * q| + |dmin * min|`` (the two parts are summed apart)."""
    weight = dequantize(raw, kind).double()
    u = unpack(raw, kind)
    if u.mins is None or u.m is None or u.scales is None:
        return weight.abs()
    low = (u.m.double().unsqueeze(-1) * u.mins.double()).repeat_interleave(32, dim=-1).reshape(weight.shape)
    return (weight + low).abs() + low.abs()


@pytest.mark.parametrize("kind", list(FORMATS))
@pytest.mark.parametrize(("out", "inp"), [(48, 64), (96, 1536), (32, 96), (16, 2080), (208, 160)])
def test_products_are_the_float64_product_of_the_rounded_inputs_to_float32_rounding(ops, kind, out, inp):
    inp = _inputs(inp, kind)
    raw, bias, x = quantized(_rand(out, inp, seed=2), kind), _rand(out, seed=3), _rand(21, inp, seed=4)
    packed = quant_pack(raw, kind)
    fmt = FORMATS[kind]
    assert quant_format(packed) == kind and packed.shape == (out // 16, inp // fmt.inputs, fmt.packed_bytes)
    _assert_reference_product(ops, raw, kind, x, bias)


def _assert_reference_product(ops, raw: torch.Tensor, kind: str, x: torch.Tensor, bias: torch.Tensor) -> None:
    """The product of ``raw`` (GGUF blocks) with ``x`` is the float64 product of the rounded inputs with the
    dequantized weight to float32 rounding, and the exact one to the inputs' rounding."""
    weight = dequantize(raw, kind).double()
    y = ops.quant_linear(x, quant_pack(raw, kind), bias)
    assert y.shape == (x.shape[0], raw.shape[0]) and y.dtype == torch.float32
    inp = x.shape[1]
    xq, scale = rounded_inputs(x, kind)
    want = xq @ weight.T + bias.double()
    # float32 roundings per block: a scale product and a fused multiply-add (two for a minimum; the K-quants' integer
    # sums converted to float too); the bias
    steps = 3 * (inp // 32) + 2
    bound = (xq.abs() @ _magnitudes(raw, kind).T + bias.abs()) * steps * 2**-23
    assert bool(((y.double() - want).abs() <= bound).all())
    # and the inputs' rounding (half a step of each block's scale) from the exact product
    exact = x.double() @ weight.T + bias.double()
    assert bool(((y.double() - exact).abs() <= (scale / 2) @ weight.abs().T * 1.01 + 1e-5).all())


LARGEST_QUANTS = {
    "Q8_0": [(2, 34, 0x80)],  # -128: |w| 128 times 127 twice is 32,512, the pair sum nearest int16's end
    "Q4_0": [(2, 18, 0xFF)],
    "Q4_1": [(4, 20, 0xFF)],
    "Q5_0": [(2, 22, 0xFF)],  # the fifth bits and the nibbles: 31
    "Q5_1": [(4, 24, 0xFF)],
    "Q4_K": [(16, 144, 0xFF)],
    "Q5_K": [(16, 176, 0xFF)],
    "Q6_K": [(0, 192, 0xFF)],  # low nibbles and high bit pairs: 63
}
"""Per format, the byte ranges of a GGUF block holding its quants and the byte that makes each quant its largest."""


@pytest.mark.parametrize("kind", list(FORMATS))
def test_the_largest_quants_times_the_largest_inputs_keep_exact_dots(ops, kind):
    """Every quant at its format's largest and every input at +-127 after rounding: the integer dots' pair sums at
    their largest (where the kernels add two pair sums in int16 before widening, 4 x 63 x 127 = 32,004 for Q6_K's)
    still give the reference product, and every row its 1-row product."""
    inp = _inputs(512, kind)
    raw = quantized(_rand(32, inp, seed=7), kind)
    blocks = raw.view(32, -1, FORMATS[kind].block_bytes)
    for begin, end, byte in LARGEST_QUANTS[kind]:
        blocks[:, :, begin:end] = byte
    x = torch.stack([torch.ones(inp), -torch.ones(inp), torch.full((inp,), 3.0), _rand(inp, seed=8)]).repeat(5, 1)
    packed = quant_pack(raw, kind)
    alone = torch.cat([ops.quant_linear(x[i : i + 1], packed, None) for i in range(4)]).repeat(5, 1)
    for rows in (4, 20):  # below and above the rows from which a pass spreads its quants to bytes first
        _assert_reference_product(ops, raw, kind, x[:rows], torch.zeros(32))
        assert torch.equal(ops.quant_linear(x[:rows], packed, None), alone[:rows])


@pytest.mark.parametrize("kind", list(FORMATS))
def test_rows_equal_one_row_products_at_every_width(ops, kind):
    inp = 224 if FORMATS[kind].inputs == 32 else 768  # 224: slices of 64 and of 32; 768: three super-blocks
    packed = quant_pack(quantized(_rand(80, inp, seed=5), kind), kind)
    x = _rand(20, inp, seed=6)
    alone = torch.cat([ops.quant_linear(x[i : i + 1], packed, None) for i in range(20)])
    for width in range(1, 21):
        assert torch.equal(ops.quant_linear(x[:width], packed, None), alone[:width]), width
    assert torch.equal(ops.quant_linear(x[3:9].reshape(2, 3, inp), packed, None).reshape(6, 80), alone[3:9])


@pytest.mark.parametrize("kind", [k for k in FORMATS if FORMATS[k].inputs == 32])
def test_products_on_amx_tiles_are_the_vector_kernels_bits(ops, kind):
    """Where the CPU grants AMX, the 32-input formats take their dots from tiles from some rows on (Q8_0 from 5, the
    nibble formats from 32, spread once per pass): every width (1..40: part of a tile of rows, one, two, a partial
    third), output counts that leave passes of 1..4 blocks, and a bias give the vector kernel's bits exactly."""
    if not ops.quant_linear_tiles():
        pytest.skip("this CPU or build runs no AMX tiles (or LATTICE_AMX=0)")
    inp = 224  # 7 blocks of 32
    for out in (16, 48, 80, 112):
        packed = quant_pack(quantized(_rand(out, inp, seed=out), kind), kind)
        bias, x = _rand(out, seed=1), _rand(40, inp, seed=2) * 4
        x[5, :32] = 0.0  # an all-zero block of inputs
        tiles = [ops.quant_linear(x[:width], packed, bias) for width in range(1, 41)]
        try:
            ops.prefer_amx(False)
            assert not ops.quant_linear_tiles()
            vector = [ops.quant_linear(x[:width], packed, bias) for width in range(1, 41)]
        finally:
            ops.prefer_amx(True)
        for width, (a, b) in enumerate(zip(tiles, vector, strict=True), 1):
            assert torch.equal(a, b), (kind, out, width)


def test_bad_input_gets_a_clear_error(ops):
    raw = quantized(_rand(32, 64, seed=7), "Q4_0")
    packed = quant_pack(raw, "Q4_0")
    with pytest.raises(RuntimeError, match="input of 63 features, the weight takes 64"):
        ops.quant_linear(_rand(2, 63), packed, None)
    with pytest.raises(RuntimeError, match="float32 input expected, got BFloat16"):
        ops.quant_linear(_rand(2, 64).bfloat16(), packed, None)
    with pytest.raises(RuntimeError, match="a float32 CPU bias of 32 values"):
        ops.quant_linear(_rand(2, 64), packed, _rand(31))
    with pytest.raises(RuntimeError, match="quant_pack's layout"):
        ops.quant_linear(_rand(2, 64), packed[..., :-1].contiguous(), None)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        ops.quant_linear(_rand(2, 64), packed.transpose(0, 1), None)
    with pytest.raises(
        ValueError, match="unsupported GGUF quantization 'Q3_K'; natively computed: Q8_0, Q4_0, Q4_1, Q5"
    ):
        quant_pack(raw, "Q3_K")
    with pytest.raises(ValueError, match="a Q8_0 tensor is uint8 \\[out, blocks \\* 34\\]"):
        quant_pack(raw, "Q8_0")
    with pytest.raises(ValueError, match="outputs must be a multiple of 16, got 8"):
        quant_pack(raw[:8], "Q4_0")
    with pytest.raises(ValueError, match="fuse only with the same format"):
        concat_packed([packed, quant_pack(quantized(_rand(32, 64), "Q8_0"), "Q8_0")])


def _quantize_model(model: torch.nn.Module, kinds: list[str]) -> list[tuple[str, str, torch.Tensor | None]]:
    """Quantize every linear layer GGUF would (out a multiple of 16) with GGUF's reference, cycling through
    ``kinds`` by layer; set the model's float32 weights to the dequantized values (what loading the file gives) and
    return the file's tensors, q/k rows permuted as llama's converter stores them (attaching must find the order)."""
    tensors: list[tuple[str, str, torch.Tensor | None]] = []
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m.out_features % 16 == 0]
    for name, module in linears:
        layer = next((int(part) for part in name.split(".") if part.isdigit()), 0)
        kind = kinds[layer % len(kinds)]  # one format per layer: fused q/k/v and gate/up need one
        raw = quantized(module.weight.detach(), kind)
        with torch.no_grad():
            module.weight.copy_(dequantize(raw, kind))
        if name.endswith(("q_proj", "k_proj")):
            raw = raw.flip(0)
        tensors.append((f"{name}.weight", kind, raw))
    tensors.append(("output_extra.weight", "Q3_K", None))  # a type without a kernel: named, left dense
    return tensors


def _quantized_toy(arch: str, kinds: list[str]):
    from lattice_testing.toy import toy_config, toy_model

    model = toy_model(toy_config(arch), init_std=0.4, seed=3)
    dense = toy_model(toy_config(arch), init_std=0.4, seed=3)
    tensors = _quantize_model(model, kinds)
    _quantize_model(dense, kinds)
    done = attach_tensors(model, tensors)
    return model, dense, done


@pytest.mark.parametrize(("arch", "kinds"), [("llama", ["Q4_1"]), ("qwen3", ["Q4_0", "Q8_0"]), ("qwen2", ["Q8_0"])])
def test_a_quantized_toy_model_decodes_speculatively_as_it_decodes_plainly(ops, arch, kinds):
    from lattice_inference.decode import SpeculativeDecoder
    from lattice_inference.drafters.ngram import NgramDrafter
    from lattice_inference.sampling import SamplingOptions
    from lattice_inference.targets.lean import LeanTarget
    from lattice_testing.toy import TOY_VOCAB

    from .helpers import FLAT_COSTS, OracleDrafter, TreeOracleDrafter

    model, dense, done = _quantized_toy(arch, kinds)
    assert quantized_weights(model) is done and sum(done.native.values()) == 14  # 2 layers x 7 projections
    assert set(done.native) == set(kinds) and done.dequantized == ["output_extra.weight (Q3_K)"]
    assert "Q3_K" in done.describe()
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.weight.device.type == "meta"  # the dense copy is gone
    lean = LeanTarget(model)
    assert lean._loop is not None and lean._loop.runs(torch.empty(0))
    packed = lean.model.model.layers[0].mlp.down_proj._lattice_packed_weight  # the target's view is packed
    assert packed_kind(packed).startswith("quant-")
    # close to the file dequantized to float32 (its inputs rounded to 8 bits), not equal to it
    prompts = [[(7 * i + j * j) % 250 for j in range(12 + i)] for i in range(4)]
    reference = LeanTarget(dense)
    their_seq, our_seq = reference.new_sequence(), lean.new_sequence()
    reference.prefill(their_seq, prompts[0][:-1])
    lean.prefill(our_seq, prompts[0][:-1])
    ours, theirs = lean.forward(our_seq, prompts[0][-1:]), reference.forward(their_seq, prompts[0][-1:])
    assert not torch.equal(ours, theirs)
    assert torch.nn.functional.cosine_similarity(ours, theirs).min() > 0.999
    plain = SpeculativeDecoder(lean, None)
    samplings = [SamplingOptions(), SamplingOptions(temperature=0.9, seed=5)]
    for s in samplings:
        for i, p in enumerate(prompts):
            want = plain.generate(p, 24, s).token_ids
            oracle = OracleDrafter(p + want, vocab=TOY_VOCAB, corrupt=0.3, seed=i)
            chain = SpeculativeDecoder(lean, oracle, max_draft=5, adaptive=False).generate(p, 24, s)
            assert chain.token_ids == want and chain.metrics.exact is True
            tree = TreeOracleDrafter(p + want, TOY_VOCAB, seed=i)
            assert SpeculativeDecoder(lean, tree, max_draft=4, costs=FLAT_COSTS).generate(p, 24, s).token_ids == want
    drafter = NgramDrafter(max_ngram=3, min_ngram=1, max_draft=4)
    repeat = [5, 6, 7, 8] * 6
    assert (
        SpeculativeDecoder(lean, drafter, adaptive=False).generate(repeat, 30).token_ids
        == plain.generate(repeat, 30).token_ids
    )


def test_quantized_layers_in_a_batch_and_under_the_transformers_forward(ops):
    from lattice_inference import Generator
    from lattice_inference.targets import make_target
    from lattice_testing.toy import byte_tokenizer

    from .helpers import FLAT_COSTS

    model, _, _ = _quantized_toy("qwen3", ["Q4_1", "Q8_0"])
    generator = Generator(model, byte_tokenizer(), method="ngram", costs=FLAT_COSTS)
    prompts = [[(3 * i + j) % 200 for j in range(10 + 2 * i)] * 2 for i in range(5)]
    alone = [generator.generate(p, 16, temperature=0.8, seed=3).token_ids for p in prompts]
    many = generator.generate_many(prompts, 16, max_batch=3, temperature=0.8, seed=3)
    assert [r.token_ids for r in many] == alone
    slow = make_target(model, forward="transformers")
    assert not slow.batches_sequences
    plain = Generator(model, byte_tokenizer(), method="greedy")
    through = Generator(model, byte_tokenizer(), method="greedy", target=slow)
    assert through.generate(prompts[0], 12).token_ids == plain.generate(prompts[0], 12).token_ids
    with pytest.raises(ValueError, match=r"quantized weights compute float32 inputs on the CPU, got torch\.bfloat16"):
        slow.model.model.layers[0].mlp.down_proj(torch.zeros(1, 128, dtype=torch.bfloat16))  # the target's view


def test_attaching_matches_by_content_and_leaves_what_matches_nothing(ops):
    from lattice_testing.toy import toy_config, toy_model

    model = toy_model(toy_config("llama"), init_std=0.4, seed=3)
    down = model.model.layers[1].mlp.down_proj
    raw = quantized(down.weight.detach(), "Q8_0")  # the weight is not the dequantized values: no match
    done = attach_tensors(model, [("blk.1.ffn_down.weight", "Q8_0", raw)])
    assert not done.native and done.dequantized == ["blk.1.ffn_down.weight (Q8_0, unmatched)"]
    assert not hasattr(down, QUANT) and down.weight.device.type == "cpu"
    assert pack_linears(model) > 0 and not quant_packed(down._lattice_packed_weight)


@pytest.mark.parametrize("build", ["avx2", "avx512-without-vnni"])
def test_every_build_computes_the_same_bits(ops, request, build):
    """The dots are exact integers and the float steps run lane-wise alike in 8 or 16 lanes: the AVX2 build (pairwise
    multiply-adds) and the AVX512 build without VNNI equal this build bit for bit, every format, any width."""
    built = ops.quant_linear_kernel()
    if built == "avx2" or (built == "avx512" and build == "avx512-without-vnni"):
        pytest.skip(f"this CPU runs the {built} build already")
    other = request.getfixturevalue("other_builds")[build]  # compiled only where the test runs
    assert other.quant_linear_kernel() == ("avx2" if build == "avx2" else "avx512")
    weight, bias, x = _rand(96, 768, seed=10), _rand(96, seed=11), _rand(23, 768, seed=12) * 3
    x[0, :32] = 0.0  # an all-zero block of inputs
    for kind in FORMATS:
        packed = quant_pack(quantized(weight, kind), kind)
        ours = ops.quant_linear(x, packed, bias)
        assert torch.equal(ours, other.quant_linear(x, packed, bias)), kind
        assert all(torch.equal(other.quant_linear(x[i : i + 1], packed, bias)[0], ours[i]) for i in range(23))


@pytest.mark.parametrize("kind", list(FORMATS))
def test_the_native_pass_packs_the_reference_layout(ops, kind):
    """Every byte of random blocks (every bit pattern of quants, high bits and sub-block scales) lands where the
    PyTorch reference puts it."""
    fmt = FORMATS[kind]
    raw = torch.randint(
        0, 256, (48, 3 * fmt.block_bytes), generator=torch.Generator().manual_seed(13), dtype=torch.uint8
    )
    assert torch.equal(ops.quant_pack(raw, kind), pack_reference(raw, kind))
    assert torch.equal(quant_pack(raw, kind), pack_reference(raw, kind))


@pytest.mark.parametrize("kind", list(FORMATS))
def test_rows_read_back_from_the_layout_are_the_files_values_bit_for_bit(ops, kind):
    """An embedding tied to its output layer reads its rows from that layer's packed blocks (one copy of the
    vocabulary): every row equals GGUF's dequantization of the file's blocks, whatever their bits."""
    from lattice_inference.models.gguf_quantized import QuantizedEmbedding

    fmt = FORMATS[kind]
    generator = torch.Generator().manual_seed(17)
    raw = torch.randint(0, 256, (48, 3, fmt.block_bytes), generator=generator, dtype=torch.uint8)
    for start in {"Q6_K": [208]}.get(kind, [0, 2] if kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else [0]):
        raw[..., start : start + 2] = torch.randn(48, 3, 1, generator=generator).half().view(torch.uint8)
    raw = raw.reshape(48, -1)
    ids = torch.tensor([0, 5, 47, 16, 31, 5])
    want = dequantize(raw, kind)
    assert torch.equal(ops.quant_rows(quant_pack(raw, kind), ids, kind).view(torch.int32), want[ids].view(torch.int32))
    embedding = QuantizedEmbedding(quant_pack(raw, kind), kind, dim=want.shape[1], native=ops)
    assert embedding.weight.shape == want.shape and torch.equal(embedding(ids[None]), want[ids][None])
    assert torch.equal(embedding.dense(), want)
    from_file = QuantizedEmbedding(raw, kind)  # the file's layout, where the native ops are not built
    assert from_file.weight.shape == want.shape and torch.equal(from_file(ids[None]), want[ids][None])
    with pytest.raises(ValueError, match="both the native ops and the row width"):
        QuantizedEmbedding(raw, kind, native=ops)
    with pytest.raises(RuntimeError, match="quant_rows: row 48 of 48"):
        ops.quant_rows(quant_pack(raw, kind), torch.tensor([48]), kind)
