"""The formats of the GGUF files people download (Q4_K_M, Q5_K_M, Q6_K, Q8_0) computed as stored.

A Q4_K_M file mixes Q4_K, Q5_K and Q6_K super-blocks with Q5_0/Q8_0 blocks (wherever a row is not a multiple of
256), often within one attention block (q/k in one format, v in another): such a fused product runs its parts side
by side in one native call, its inputs quantized once per kind of activation, each part's outputs equal to its own
product bit for bit. Toy models of each family (Llama, Qwen2 with its biases, Qwen3 with its q/k norms, Gemma 3 with
its scaled embedding, sliding layers and extra norms), every layer in such a mix, decode speculatively exactly as
they decode plainly: greedy and seeded, chains and trees, alone and in batches. The kernels per format:
``tests/test_quant_linear.py``; the real files: ``tests/test_real_gguf_files.py``.
"""

from __future__ import annotations

import pytest
import torch

from lattice_inference.kernels.packed_linear import QUANT, packed_kind
from lattice_inference.kernels.quant_linear import dequantize, quant_pack
from lattice_inference.models.gguf_quantized import QuantizedEmbedding, attach_tensors
from lattice_testing.gguf_blocks import quantize

from .test_quant_linear import _rand

pytest.importorskip("gguf")

Q4_K_M = {
    "q_proj": "Q4_K",
    "k_proj": "Q4_K",
    "v_proj": "Q6_K",
    "o_proj": "Q5_K",
    "gate_proj": "Q5_0",
    "up_proj": "Q5_1",
    "down_proj": "Q6_K",
}
"""Per projection a format, as llama.cpp's Q4_K_M mixes them (and every format but Q8_0, the kernels' oldest)."""


def test_parts_side_by_side_equal_each_parts_own_product(quant_ops):
    ops = quant_ops
    kinds = ["Q4_K", "Q6_K", "Q5_0", "Q8_0"]
    packed = [quant_pack(quantize(_rand(32 * (i + 1), 512, seed=i), k), k) for i, k in enumerate(kinds)]
    bias, x = _rand(sum(p.shape[0] * 16 for p in packed), seed=9), _rand(7, 512, seed=10)
    fused = ops.quant_linear_parts(x, packed, bias)
    alone = torch.cat([ops.quant_linear(x, p, None) for p in packed], dim=-1) + bias
    assert torch.equal(fused, alone)
    rows = torch.cat([ops.quant_linear_parts(x[i : i + 1], packed, bias) for i in range(7)])
    assert torch.equal(rows, fused)
    with pytest.raises(RuntimeError, match="fused weights take 512 and 256 inputs"):
        ops.quant_linear_parts(x, [packed[0], quant_pack(quantize(_rand(16, 256), "Q4_K"), "Q4_K")], None)


def _quantized_toy(arch: str, **overrides: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A toy of ``arch`` (dimensions multiples of 256) whose linear layers are GGUF blocks in the `Q4_K_M` mix,
    attached by content; and the same model left dense (its weights the blocks' values)."""
    from lattice_testing.toy import toy_config, toy_model

    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    models = [toy_model(toy_config(arch, **{**shape, **overrides}), init_std=0.05, seed=3) for _ in range(2)]
    tensors = []
    for (name, module), (_, twin) in zip(models[0].named_modules(), models[1].named_modules(), strict=True):
        if isinstance(module, torch.nn.Linear) and name != "lm_head":  # 259 outputs: not in blocks of 16
            kind = Q4_K_M[name.rsplit(".", 1)[-1]]
            raw = quantize(module.weight.detach(), kind)
            with torch.no_grad():
                module.weight.copy_(dequantize(raw, kind))
                twin.weight.copy_(module.weight)
            tensors.append((f"{name}.weight", kind, raw))
    done = attach_tensors(models[0], tensors)
    assert sum(done.native.values()) == len(tensors) and set(done.native) == set(Q4_K_M.values())
    return models[0], models[1]


LLAMA_3_2 = dict(
    tie_word_embeddings=True,
    rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    },
)  # fmt: skip
"""Llama 3.2's shape beside Llama's: tied embeddings, llama3 rotary scaling."""


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("llama", {}), ("llama", LLAMA_3_2), ("qwen2", {}), ("qwen3", {}), ("gemma3_text", {})],
    ids=["llama", "llama3.2", "qwen2", "qwen3", "gemma3"],
)
def test_a_q4_k_m_toy_decodes_speculatively_as_it_decodes_plainly(quant_ops, arch, overrides):
    from lattice_inference import Generator
    from lattice_inference.decode import SpeculativeDecoder
    from lattice_inference.sampling import SamplingOptions
    from lattice_inference.targets import make_target
    from lattice_inference.targets.exactness import check_exactness
    from lattice_inference.targets.lean import LeanTarget
    from lattice_testing.toy import TOY_VOCAB, byte_tokenizer

    from .helpers import FLAT_COSTS, OracleDrafter, TreeOracleDrafter

    model, dense = _quantized_toy(arch, **overrides)
    if overrides:
        assert model.config.tie_word_embeddings and model.config.rope_parameters["rope_type"] == "llama3"
    target = make_target(model)
    assert isinstance(target, LeanTarget) and target.native
    view = target.model.model.layers[0]  # the target packs its own view of the model
    assert packed_kind(view.self_attn.q_proj._lattice_packed_weight.packed) == "quant-Q4_K+Q4_K+Q6_K"
    assert target._loop is not None and target.quantized and target.batches_sequences  # the native layer loop
    if arch == "gemma3_text":  # a sliding and a global layer, their rotary tables, output norms, GELU
        assert [layer.window for layer in target._layers] == [24, None] and target._loop.gelu is True  # GELU
        assert target._loop.rope_kinds == ["full_attention", "sliding_attention"]
    # close to the dense model (its inputs rounded to 8 bits), not equal to it
    prompt = [(7 * j + 3) % 250 for j in range(20)]
    with torch.no_grad():
        ours = model(torch.tensor([prompt])).logits[0, -1]
        theirs = dense(torch.tensor([prompt])).logits[0, -1]
    assert not torch.equal(ours, theirs) and torch.nn.functional.cosine_similarity(ours, theirs, dim=0) > 0.99
    report = check_exactness(target, 8)
    assert report.exact and report.trees and report.batched, report.failures
    plain = SpeculativeDecoder(target, None)
    prompts = [[(5 * i + j * j) % 250 for j in range(10 + 3 * i)] for i in range(3)]
    for sampling in (SamplingOptions(), SamplingOptions(temperature=0.9, seed=5)):
        for i, p in enumerate(prompts):
            want = plain.generate(p, 20, sampling).token_ids
            oracle = OracleDrafter(p + want, vocab=TOY_VOCAB, corrupt=0.3, seed=i)
            chain = SpeculativeDecoder(target, oracle, max_draft=5, adaptive=False).generate(p, 20, sampling)
            assert chain.token_ids == want and chain.metrics.exact is True
            assert target.verifies_trees  # Gemma's too: its trees cross the window (24 keys) within 30 positions
            tree = TreeOracleDrafter(p + want, TOY_VOCAB, seed=i)
            assert (
                SpeculativeDecoder(target, tree, max_draft=4, costs=FLAT_COSTS).generate(p, 20, sampling).token_ids
                == want
            )
    generator = Generator(model, byte_tokenizer(), method="ngram", costs=FLAT_COSTS, target=target)
    repeats = [[(3 * i + j) % 200 for j in range(8 + 2 * i)] * 3 for i in range(4)]
    alone = [generator.generate(p, 16, temperature=0.8, seed=3).token_ids for p in repeats]
    many = generator.generate_many(repeats, 16, max_batch=3, temperature=0.8, seed=3)
    assert [r.token_ids for r in many] == alone


def test_a_scaled_embedding_kept_in_blocks_looks_up_what_the_models_own_does():
    from lattice_testing.toy import toy_config, toy_model

    model = toy_model(toy_config("gemma3_text", hidden_size=256), init_std=0.05, seed=1)
    own = model.get_input_embeddings()
    raw = quantize(own.weight.detach(), "Q5_0")
    with torch.no_grad():
        own.weight.copy_(dequantize(raw, "Q5_0"))
    blocks = QuantizedEmbedding(raw, "Q5_0", own.embed_scale)
    ids = torch.tensor([[1, 5, 250, 7]])
    assert torch.equal(blocks(ids), own(ids)) and not torch.equal(blocks(ids), own.weight[ids])
    assert torch.equal(blocks.dense(), own.weight)
    assert not hasattr(own, QUANT)


def test_a_tree_over_sliding_window_layers_sees_each_rows_window_by_position(quant_ops):
    """The PyTorch forward (no decode matching) of a draft tree over Gemma 3's sliding-window layers: each row's
    logits are those of its own path fed as a chain (a row sees the keys of the window before its position, its
    ancestors included, not by column: a second branch's rows sit further right than their depth)."""
    from lattice_inference.targets import make_target
    from lattice_testing.toy import toy_config, toy_model

    model = toy_model(toy_config("gemma3_text", hidden_size=256), init_std=0.05, seed=1)
    target = make_target(model, decode_matched=False)
    assert target.verifies_trees and [layer.window for layer in target._layers] == [24, None]
    prompt = [(7 * j + 3) % 250 for j in range(22)]  # the tree's rows at positions 22-25 cross the window of 24
    tokens, parents = [11, 12, 13, 21, 22, 23], [-1, 0, 1, 0, 3, 4]  # two branches after the root
    seq = target.new_sequence()
    target.prefill(seq, prompt)
    tree = target.forward_tree(seq, tokens, parents).clone()
    paths = {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 3], 4: [0, 3, 4], 5: [0, 3, 4, 5]}
    for row, path in paths.items():
        target.prefill(seq, prompt)
        chain = target.forward(seq, [tokens[r] for r in path])[-1]
        assert torch.allclose(tree[row], chain, atol=1e-4, rtol=1e-4), f"row {row} of the tree"
