"""oneDNN-packed linear layers: same results as ``F.linear`` to float rounding, fused sibling projections,
fallbacks, and undo."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lattice_inference.kernels.packed_linear import _PACKED, pack_linears, packing_supported, unpack_linears
from lattice_inference.targets import TransformersTarget
from lattice_testing.toy import toy_config, toy_model

pytestmark = pytest.mark.skipif(not packing_supported(torch.float32), reason="oneDNN cannot pack float32 here")


def logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])  # separate q/k/v, q/k/v with biases, fused qkv
def test_packed_model_matches_the_dense_one_and_unpacks_exactly(arch: str) -> None:
    model = toy_model(toy_config(arch), init_std=0.5, seed=3)
    ids = [5, 17, 200, 3, 99, 41, 8]
    dense = logits(model, ids)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert pack_linears(model) == linears
    assert pack_linears(model) == linears  # idempotent
    packed = logits(model, ids)
    torch.testing.assert_close(packed, dense, rtol=1e-4, atol=1e-4)
    assert torch.equal(packed.argmax(-1), dense.argmax(-1))
    unpack_linears(model)
    assert not any(hasattr(m, _PACKED) for m in model.modules())
    assert torch.equal(logits(model, ids), dense)


def test_sibling_projections_share_one_packed_matrix() -> None:
    model = toy_model(toy_config("llama"), seed=1)
    pack_linears(model)
    attn = model.model.layers[0].self_attn
    mlp = model.model.layers[0].mlp
    assert getattr(attn.q_proj, _PACKED) is getattr(attn.k_proj, _PACKED) is getattr(attn.v_proj, _PACKED)
    assert getattr(mlp.gate_proj, _PACKED) is getattr(mlp.up_proj, _PACKED)
    assert getattr(attn.o_proj, _PACKED) is not getattr(attn.q_proj, _PACKED)


def test_a_fused_member_called_alone_or_on_another_input_gives_its_own_product() -> None:
    model = toy_model(toy_config("llama"), init_std=0.5, seed=2)
    attn = model.model.layers[0].self_attn
    x, y = torch.randn(1, 3, attn.q_proj.in_features), torch.randn(1, 3, attn.q_proj.in_features)
    want = {name: getattr(attn, name)(t) for name in ("q_proj", "k_proj", "v_proj") for t in (x, y)}
    pack_linears(model)
    with torch.inference_mode():
        got_k_first = attn.k_proj(x)  # out of order
        got_q_other = attn.q_proj(y)  # another input: recomputed, not the cached slice of x
        got_v = attn.v_proj(x)
    torch.testing.assert_close(got_k_first, nn.functional.linear(x, attn.k_proj.weight), rtol=1e-4, atol=1e-5)
    assert got_q_other.shape == want["q_proj"].shape
    torch.testing.assert_close(got_q_other, nn.functional.linear(y, attn.q_proj.weight), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_v, nn.functional.linear(x, attn.v_proj.weight), rtol=1e-4, atol=1e-5)


def test_a_model_cast_after_packing_runs_its_new_dense_weights() -> None:
    layer = nn.Linear(16, 8)
    pack_linears(layer)
    layer.double()  # the packed float32 copy no longer matches the input dtype
    x = torch.randn(2, 16, dtype=torch.float64)
    assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))


def test_target_packs_by_default_and_can_be_told_not_to() -> None:
    model = toy_model(toy_config("qwen3"), seed=4)
    assert any(hasattr(m, _PACKED) for m in TransformersTarget(model).model.modules())  # its own view
    assert not any(hasattr(m, _PACKED) for m in model.modules())  # never the caller's model
    plain = TransformersTarget(model, packed_weights=False)
    assert not any(hasattr(m, _PACKED) for m in plain.model.modules())
