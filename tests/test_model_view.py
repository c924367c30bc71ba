"""A target prepares its own view of the model (`model_view.runner_view`), never the caller's: the caller's modules,
config and outputs stay as they were, the weights are shared, not copied, and targets over one model share one
packed copy of each weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lattice_inference.kernels.decode_matched import ATTENTION
from lattice_inference.kernels.packed_linear import _PACKED, QUANT
from lattice_inference.targets import make_target
from lattice_inference.targets.model_view import runner_view
from lattice_testing.toy import toy_config, toy_model


def _logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def _patched(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` carrying anything a target adds (an instance ``forward``, packing)."""
    return [name for name, m in model.named_modules() if "forward" in vars(m) or hasattr(m, _PACKED)]


@pytest.mark.parametrize("forward", ["lean", "transformers"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_target_leaves_the_callers_model_as_it_was(arch: str, forward: str) -> None:
    model = toy_model(toy_config(arch), init_std=0.5, seed=5)
    ids = [3, 17, 200, 9, 41]
    before = _logits(model, ids)
    attention = model.config._attn_implementation
    target = make_target(model, forward=forward)
    seq = target.new_sequence()
    target.prefill(seq, ids)
    target.forward(seq, [7, 8, 9])

    assert _patched(model) == []
    assert model.config._attn_implementation == attention == "sdpa"
    assert torch.equal(_logits(model, ids), before)  # the caller's forward, bit for bit what it was
    view = target.model
    assert view is not model and view.config is not model.config
    assert view.config._attn_implementation == ATTENTION  # the view is the one switched
    assert _patched(view)  # and the one packed
    mine = dict(model.named_parameters())
    shared = [name for name, p in view.named_parameters() if p is mine[name]]
    assert len(shared) == len(mine)  # every weight the caller's own tensor: nothing copied


def test_targets_over_one_model_share_each_packed_weight() -> None:
    model = toy_model(toy_config("llama"), seed=2)
    first, second = make_target(model, forward="lean"), make_target(model, forward="lean")
    pairs = list(zip(first.model.modules(), second.model.modules(), strict=True))
    packed = [(getattr(a, _PACKED), getattr(b, _PACKED)) for a, b in pairs if hasattr(a, _PACKED)]
    assert packed
    for a, b in packed:
        a_packed = a.packed if hasattr(a, "packed") else a  # a fused group holds its matrix
        b_packed = b.packed if hasattr(b, "packed") else b
        assert a_packed is b_packed


def test_the_view_has_its_own_modules_hooks_and_config() -> None:
    model = toy_model(toy_config("llama"), seed=1)
    view = runner_view(model)
    pairs = list(zip(model.modules(), view.modules(), strict=True))
    assert all(a is not b for a, b in pairs)
    seen: list[int] = []
    view.model.norm.register_forward_hook(lambda *_: seen.append(1))
    _logits(model, [1, 2, 3])
    assert seen == []  # a hook on the view is not the caller's
    _logits(view, [1, 2, 3])
    assert seen == [1]
    # one config object wherever the model shares one
    assert view.model.layers[0].self_attn.config is view.config is view.model.config


def test_a_quantized_model_runs_as_loaded_and_every_target_reads_its_blocks(quant_ops) -> None:
    from lattice_inference.kernels.quant_linear import dequantize
    from lattice_inference.models.gguf_quantized import attach_tensors
    from lattice_testing.gguf_blocks import quantize

    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model = toy_model(toy_config("llama", **shape), init_std=0.05, seed=3)
    dense = toy_model(toy_config("llama", **shape), init_std=0.05, seed=3)
    tensors = []
    for (name, m), twin in zip(model.named_modules(), dense.modules(), strict=True):
        if isinstance(m, nn.Linear) and name != "lm_head":
            raw = quantize(m.weight.detach(), "Q8_0")
            with torch.no_grad():
                m.weight.copy_(dequantize(raw, "Q8_0"))  # attached by content: the weight its blocks give
                twin.weight.copy_(m.weight)
            tensors.append((f"{name}.weight", "Q8_0", raw))
    attach_tensors(model, tensors)  # a GGUF file's load: its layers now compute from the blocks alone
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.weight.device.type == "meta"
    ids = [5, 9, 77, 3, 41]
    ours, theirs = _logits(model, ids), _logits(dense, ids)  # the loaded model runs on its own, from its blocks
    assert not torch.equal(ours, theirs) and torch.nn.functional.cosine_similarity(ours, theirs).min() > 0.99
    group = getattr(attention.q_proj, _PACKED)
    blocks = [getattr(m, QUANT) for m in (attention.q_proj, attention.k_proj, attention.v_proj)]
    assert all(b.untyped_storage().data_ptr() == group.packed.untyped_storage().data_ptr() for b in blocks)
    targets = [make_target(model, forward="lean"), make_target(model, forward="lean")]
    for target in targets:  # each view routes to the loaded model's one copy of the blocks
        assert getattr(target.model.model.layers[0].self_attn.q_proj, _PACKED) is group
        assert target._loop is not None  # the native layer loop found the fused product through the view
    first, second = (t.new_sequence() for t in targets)
    assert torch.equal(targets[0].prefill(first, ids), targets[1].prefill(second, ids))
