"""GGUF weights kept quantized (Q8_0, Q4_0, Q4_1) and computed by our products (``quant_linear``).

GGUF's reference (the ``gguf`` package: ``gguf.quants.quantize``/``dequantize``) makes the blocks and says what
they are worth. Our dequantization equals it bit for bit; a quantized product equals the float32 row product over
the dequantized weight bit for bit (within float32 rounding of the float64 product), every row alike at widths
1..20 and awkward input sizes; errors name what is wrong; and a quantized toy model (its linear layers attached by
content, rows permuted as llama's GGUF q/k are) runs the native layer loop, with speculation, draft trees, seeded
sampling and batches equal to its plain decoding. The AVX2 build's quantized products equal the AVX512 build's
in ``tests/test_rows_linear.py``; the real Q4_1 file in ``tests/test_real_model.py``.
"""

from __future__ import annotations

import pytest
import torch

from lattice_inference.quantized import attach_tensors, quantized_weights
from lattice_inference.targets import native_ops
from lattice_inference.targets.packed_linear import QUANT, pack_linears, packed_kind, quant_packed
from lattice_inference.targets.quant_linear import FORMATS, concat_packed, dequantize, quant_format, quant_pack

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def ops():
    built = native_ops.rows()
    if built is None:
        pytest.skip(f"our products do not run here ({native_ops.unavailable() or 'no AVX2 with FMA'})")
    return built


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def quantized(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """GGUF's own quantization of a float32 ``[out, in]`` weight: uint8 ``[out, bytes]``."""
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    return torch.from_numpy(gguf.quants.quantize(weight.numpy(), qtype))


@pytest.mark.parametrize("kind", list(FORMATS))
def test_dequantize_is_ggufs_reference_bit_for_bit(kind):
    weight = _rand(48, 160, seed=1) * torch.logspace(-3, 1, 160)  # scales across magnitudes
    weight[3, :32] = 0.0  # an all-zero block
    raw = quantized(weight, kind)
    want = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), getattr(gguf.GGMLQuantizationType, kind)))
    ours = dequantize(raw, kind)
    assert ours.dtype == torch.float32 and ours.shape == weight.shape
    assert torch.equal(ours.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("kind", list(FORMATS))
@pytest.mark.parametrize(("out", "inp"), [(48, 64), (96, 1536), (32, 96), (16, 2080), (208, 160)])
def test_products_equal_the_float32_row_product_over_the_dequantized_weight(ops, kind, out, inp):
    raw, bias, x = quantized(_rand(out, inp, seed=2), kind), _rand(out, seed=3), _rand(21, inp, seed=4)
    packed = quant_pack(raw, kind)
    assert quant_format(packed) == kind and packed.shape == (out // 16, inp // 32, FORMATS[kind][1])
    weight = dequantize(raw, kind)
    y = ops.quant_linear(x, packed, bias)
    assert torch.equal(y, ops.rows_linear(x, ops.rows_pack(weight), bias))
    want = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    bound = (x.double().abs() @ weight.double().abs().T + bias.double().abs()) * inp * 2**-23
    assert bool(((y.double() - want).abs() <= bound).all())


@pytest.mark.parametrize("kind", list(FORMATS))
def test_rows_equal_one_row_products_at_every_width(ops, kind):
    packed = quant_pack(quantized(_rand(80, 224, seed=5), kind), kind)  # 224 inputs: slices of 64 and of 32
    x = _rand(20, 224, seed=6)
    alone = torch.cat([ops.quant_linear(x[i : i + 1], packed, None) for i in range(20)])
    for width in range(1, 21):
        assert torch.equal(ops.quant_linear(x[:width], packed, None), alone[:width]), width
    assert torch.equal(ops.quant_linear(x[3:9].reshape(2, 3, 224), packed, None).reshape(6, 80), alone[3:9])


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
    with pytest.raises(ValueError, match="unsupported GGUF quantization 'Q4_K'; natively computed: Q8_0, Q4_0, Q4_1"):
        quant_pack(raw, "Q4_K")
    with pytest.raises(ValueError, match="a Q8_0 tensor is uint8 \\[out, blocks \\* 34\\]"):
        quant_pack(raw, "Q8_0")
    with pytest.raises(ValueError, match="outputs must be a multiple of 16, got 8"):
        quant_pack(raw[:8], "Q4_0")
    with pytest.raises(ValueError, match="fuse only with the same format"):
        concat_packed([packed, quant_pack(quantized(_rand(32, 64), "Q8_0"), "Q8_0")])


def _quantize_model(model: torch.nn.Module, kinds: list[str]) -> list[tuple[str, str, torch.Tensor | None]]:
    """Quantize every linear layer GGUF would (out a multiple of 16) with GGUF's reference, cycling through
    ``kinds`` by layer; set the model's float32 weights to the dequantized values (what loading the file gives) and return
    the file's tensors, q/k rows permuted as llama's converter stores them (attaching must find the order)."""
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
    tensors.append(("output_extra.weight", "Q6_K", None))  # a type without a kernel: named, left dense
    return tensors


def _quantized_toy(arch: str, kinds: list[str]):
    from lattice_inference.testing.toy import toy_config, toy_model

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
    from lattice_inference.testing.toy import TOY_VOCAB

    from .helpers import FLAT_COSTS, OracleDrafter, TreeOracleDrafter

    model, dense, done = _quantized_toy(arch, kinds)
    assert quantized_weights(model) is done and sum(done.native.values()) == 14  # 2 layers x 7 projections
    assert set(done.native) == set(kinds) and done.dequantized == ["output_extra.weight (Q6_K)"]
    assert "Q6_K" in done.describe()
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.weight.device.type == "meta"  # the dense copy is gone
    lean = LeanTarget(model)
    assert lean._loop is not None and lean._loop.runs(torch.empty(0))
    assert packed_kind(layer.mlp.down_proj._lattice_packed_weight).startswith("quant-")
    # the same tokens as the dequantized float32 model on the float32 row kernel
    prompts = [[(7 * i + j * j) % 250 for j in range(12 + i)] for i in range(4)]
    plain = SpeculativeDecoder(lean, None)
    reference = SpeculativeDecoder(LeanTarget(dense), None)
    for p in prompts:
        assert plain.generate(p, 24).token_ids == reference.generate(p, 24).token_ids
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
    assert SpeculativeDecoder(lean, drafter, adaptive=False).generate(repeat, 30).token_ids == plain.generate(
        repeat, 30
    ).token_ids


def test_quantized_layers_in_a_batch_and_under_the_transformers_forward(ops):
    from lattice_inference import Generator
    from lattice_inference.targets import make_target
    from lattice_inference.testing.toy import byte_tokenizer

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
    with pytest.raises(ValueError, match="quantized weights compute float32 inputs on the CPU, got torch.bfloat16"):
        model.model.layers[0].mlp.down_proj(torch.zeros(1, 128, dtype=torch.bfloat16))


def test_attaching_matches_by_content_and_leaves_what_matches_nothing(ops):
    from lattice_inference.testing.toy import toy_config, toy_model

    model = toy_model(toy_config("llama"), init_std=0.4, seed=3)
    down = model.model.layers[1].mlp.down_proj
    raw = quantized(down.weight.detach(), "Q8_0")  # the weight is not the dequantized values: no match
    done = attach_tensors(model, [("blk.1.ffn_down.weight", "Q8_0", raw)])
    assert not done.native and done.dequantized == ["blk.1.ffn_down.weight (Q8_0, unmatched)"]
    assert not hasattr(down, QUANT) and down.weight.device.type == "cpu"
    assert pack_linears(model) > 0 and not quant_packed(down._lattice_packed_weight)
