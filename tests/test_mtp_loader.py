"""The MTP loader: layouts, sharding, tied heads and every error it promises (nothing built on error)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lattice_inference.errors import ConfigError, ModelLoadError
from lattice_inference.mtp import MtpConfig, load_mtp_head
from lattice_inference.mtp.weights import detect_layout, index_checkpoint, plan_load
from lattice_testing.mtp_checkpoint import (
    build_tiny_checkpoint,
    embed_name,
    tiny_hf_config,
    to_per_expert,
    write_checkpoint,
)

P = "mtp.layers.0."


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory):
    """A Qwen3.5-MoE head written fused; returns (hf config, MtpConfig, fused tensors)."""
    _, cfg, tensors = build_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "m", "qwen3_5_moe", seed=3)
    return tiny_hf_config("qwen3_5_moe"), cfg, tensors


def _outputs(path: Path, cfg: MtpConfig) -> list[torch.Tensor]:
    head = load_mtp_head(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    hid = torch.randn(3, cfg.hidden_size, generator=gen)
    logits, hiddens = head.forward_many([3, 1, 4], range(3), hid)
    nxt, h = head.forward_one(int(logits[-1].argmax()), 3, hiddens[-1])
    return [logits, hiddens, nxt, h]


def test_fused_and_per_expert_layouts_give_identical_outputs(moe, tmp_path: Path) -> None:
    hf, cfg, tensors = moe
    fused = write_checkpoint(tmp_path / "fused", hf, tensors)
    per_expert = write_checkpoint(tmp_path / "per", hf, to_per_expert(tensors))
    assert load_mtp_head(fused).layout == "fused"
    assert load_mtp_head(per_expert).layout == "per_expert"
    for a, b in zip(_outputs(fused, cfg), _outputs(per_expert, cfg), strict=True):
        # Same weights bit for bit; only BLAS rounding (buffer alignment) may differ.
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_sharded_index_loads_the_same_head(moe, tmp_path: Path) -> None:
    hf, cfg, tensors = moe
    single = write_checkpoint(tmp_path / "single", hf, tensors)
    sharded = write_checkpoint(tmp_path / "sharded", hf, to_per_expert(tensors), shards=3)
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    for a, b in zip(_outputs(single, cfg), _outputs(sharded, cfg), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_dense_tied_head_uses_the_embedding(tmp_path: Path) -> None:
    path, cfg, tensors = build_tiny_checkpoint(tmp_path / "d", "qwen3_5")
    assert cfg.tie_word_embeddings and not cfg.is_moe and "lm_head.weight" not in tensors
    head = load_mtp_head(path)
    assert head.layout == "dense"
    logits, hidden = head.forward_one(2, 0, torch.randn(cfg.hidden_size))
    emb = tensors[embed_name("qwen3_5")]
    torch.testing.assert_close(logits, emb @ hidden, atol=1e-4, rtol=1e-4)


def test_bfloat16_checkpoint_defaults_to_bfloat16_and_shares_given_tensors(tmp_path: Path) -> None:
    path, _, tensors = build_tiny_checkpoint(tmp_path / "b", "qwen3_next", dtype=torch.bfloat16)
    assert load_mtp_head(path).dtype == torch.bfloat16
    assert load_mtp_head(path, dtype=torch.float32).dtype == torch.float32
    emb = tensors["model.embed_tokens.weight"]
    head = load_mtp_head(path, embed_tokens=emb, lm_head=tensors["lm_head.weight"])
    assert head._embed.data_ptr() == emb.data_ptr()  # shared, not copied
    with pytest.raises(ModelLoadError, match="dtype"):
        load_mtp_head(path, dtype=torch.float16)
    with pytest.raises(ModelLoadError, match=r"given embed_tokens has the wrong shape: expected \[160, 48\]"):
        load_mtp_head(path, embed_tokens=emb[:10])


def _broken(tmp_path: Path, moe, edit) -> Path:
    hf, _, tensors = moe
    tensors = dict(tensors)
    edit(tensors)
    return write_checkpoint(tmp_path / "broken", hf, tensors)


@pytest.mark.parametrize(
    ("name", "shape", "message"),
    [
        (P + "self_attn.k_proj.weight", (16, 48), r"tensor mtp\.layers\.0\.self_attn\.k_proj\.weight has the wrong "
         r"shape: expected \[32, 48\], actual \[16, 48\]"),
        (P + "mlp.experts.gate_up_proj", (6, 16, 48), r"mlp\.experts\.gate_up_proj .*expected \[6, 32, 48\], actual "
         r"\[6, 16, 48\]"),
        ("mtp.fc.weight", (48, 48), r"unexpected mtp\.fc\.weight shape \[48, 48\]; expected fusion projection "
         r"\[48, 96\]"),
        (P + "mlp.shared_expert_gate.weight", (2, 48), r"shared_expert_gate\.weight .*expected \[1, 48\], actual "
         r"\[2, 48\]"),
        ("lm_head.weight", (150, 48), r"lm_head\.weight .*expected \[160, 48\].*actual \[150, 48\]"),
    ],
)  # fmt: skip
def test_shape_errors_name_tensor_expected_and_actual(moe, tmp_path: Path, name, shape, message) -> None:
    path = _broken(tmp_path, moe, lambda t: t.__setitem__(name, torch.zeros(shape)))
    with pytest.raises(ModelLoadError, match=message):
        load_mtp_head(path)


def test_shared_expert_gate_may_be_flat(moe, tmp_path: Path) -> None:
    name = P + "mlp.shared_expert_gate.weight"
    path = _broken(tmp_path, moe, lambda t: t.__setitem__(name, t[name].reshape(-1)))
    assert load_mtp_head(path).layout == "fused"


def test_missing_tensor_is_named(moe, tmp_path: Path) -> None:
    path = _broken(tmp_path, moe, lambda t: t.pop(P + "self_attn.q_norm.weight"))
    with pytest.raises(ModelLoadError, match=r"missing MTP tensor mtp\.layers\.0\.self_attn\.q_norm\.weight"):
        load_mtp_head(path)


def test_missing_expert_is_named(moe, tmp_path: Path) -> None:
    hf, _, tensors = moe
    per = to_per_expert(tensors)
    del per[P + "mlp.experts.4.up_proj.weight"]
    path = write_checkpoint(tmp_path / "x", hf, per)
    with pytest.raises(ModelLoadError, match=r"missing MTP expert 4: tensor mtp\.layers\.0\.mlp\.experts\.4\.up_proj"):
        load_mtp_head(path)
    per[P + "mlp.experts.4.up_proj.weight"] = per[P + "mlp.experts.3.up_proj.weight"]
    per[P + "mlp.experts.6.up_proj.weight"] = per[P + "mlp.experts.3.up_proj.weight"]
    path = write_checkpoint(tmp_path / "y", hf, per)
    with pytest.raises(ModelLoadError, match="expert 6 but config declares num_experts=6"):
        load_mtp_head(path)


def test_checkpoint_without_mtp_tensors(moe, tmp_path: Path) -> None:
    path = _broken(tmp_path, moe, lambda t: [t.pop(k) for k in list(t) if k.startswith("mtp.")])
    with pytest.raises(ModelLoadError, match=r"no MTP weights \(no 'mtp\.\*' tensors\)"):
        load_mtp_head(path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.__setitem__(P + "self_attn.o_proj.weight", t[P + "self_attn.o_proj.weight"].to(torch.int8)),
         r"quantised MTP weights are not supported: tensor mtp\.layers\.0\.self_attn\.o_proj\.weight is stored as I8"),
        (lambda t: t.__setitem__("mtp.fc.weight", t["mtp.fc.weight"].to(torch.float8_e4m3fn)),
         r"quantised MTP weights .*mtp\.fc\.weight is stored as F8_E4M3"),
        (lambda t: t.__setitem__("mtp.fc.weight_scale_inv", torch.ones(1, 1)),
         r"quantised MTP weights are not supported: .*mtp\.fc\.weight_scale_inv"),
        (lambda t: t.__setitem__(P + "self_attn.q_proj.qweight", torch.ones(1, dtype=torch.int32)),
         r"quantised MTP weights .*q_proj\.qweight"),
    ],
)  # fmt: skip
def test_quantised_mtp_tensors_get_their_own_message(moe, tmp_path: Path, edit, message) -> None:
    with pytest.raises(ModelLoadError, match=message):
        load_mtp_head(_broken(tmp_path, moe, edit))


def test_layout_and_config_disagreements(moe, tmp_path: Path) -> None:
    hf, _, tensors = moe
    dense = {k: v for k, v in tensors.items() if ".mlp." not in k}
    dense |= {P + "mlp.gate_proj.weight": torch.zeros(4, 48), P + "mlp.up_proj.weight": torch.zeros(4, 48)}
    with pytest.raises(ModelLoadError, match=r"config declares a MoE MTP head .* dense MTP MLP"):
        load_mtp_head(write_checkpoint(tmp_path / "a", hf, dense))
    mixed = dict(tensors) | {P + "mlp.experts.0.gate_proj.weight": torch.zeros(16, 48)}
    with pytest.raises(ModelLoadError, match="mixes the fused"):
        load_mtp_head(write_checkpoint(tmp_path / "b", hf, mixed))
    no_experts = {k: v for k, v in tensors.items() if ".experts." not in k}
    with pytest.raises(ModelLoadError, match="no MTP expert tensors"):
        load_mtp_head(write_checkpoint(tmp_path / "c", hf, no_experts))
    two_layers = dict(tensors) | {"mtp.layers.1.input_layernorm.weight": torch.zeros(48)}
    with pytest.raises(ModelLoadError, match=r"MTP layers \[0, 1\]"):
        load_mtp_head(write_checkpoint(tmp_path / "d", hf, two_layers))
    dense_hf = tiny_hf_config("qwen3_5", tie_word_embeddings=False)
    with pytest.raises(ModelLoadError, match="config declares a dense MTP head"):
        load_mtp_head(write_checkpoint(tmp_path / "e", dense_hf, tensors))
    assert detect_layout(["mtp.fc.weight"]) is None


def test_missing_trunk_tensors(moe, tmp_path: Path) -> None:
    path = _broken(tmp_path, moe, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor lm_head\.weight \(tie_word_embeddings is false"):
        load_mtp_head(path)
    path = _broken(tmp_path / "e", moe, lambda t: t.pop(embed_name("qwen3_5_moe")))
    with pytest.raises(ModelLoadError, match="missing embedding tensor"):
        load_mtp_head(path)


def test_plain_embed_name_is_accepted(moe, tmp_path: Path) -> None:
    def rename(t):
        t["model.embed_tokens.weight"] = t.pop(embed_name("qwen3_5_moe"))

    head = load_mtp_head(_broken(tmp_path, moe, rename))
    assert head.cache_len == 0


def test_directory_errors(tmp_path: Path, moe) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        index_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no safetensors checkpoint"):
        index_checkpoint(tmp_path / "empty")
    hf, _, tensors = moe
    sharded = write_checkpoint(tmp_path / "s", hf, tensors, shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors listed in"):
        load_mtp_head(sharded)
    with pytest.raises(ConfigError, match=r"no config\.json"):
        load_mtp_head(tmp_path / "empty")


def test_validation_happens_before_any_read(moe, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shape error must be found from the headers alone, before any tensor data is read."""
    from lattice_inference.mtp import weights

    path = _broken(tmp_path, moe, lambda t: t.__setitem__(P + "self_attn.v_proj.weight", torch.zeros(3, 48)))
    monkeypatch.setattr(weights, "_read", lambda *a, **k: pytest.fail("tensor data read before validation"))
    with pytest.raises(ModelLoadError, match="v_proj"):
        load_mtp_head(path)
    hf, cfg, tensors = moe
    plan = plan_load(index_checkpoint(write_checkpoint(tmp_path / "ok", hf, tensors)), cfg)
    assert plan.layout == "fused" and plan.embed is not None and plan.lm_head is not None
    assert json.loads((tmp_path / "ok" / "config.json").read_text())["model_type"] == "qwen3_5_moe"


def test_head_checks_directly_built_weights(moe) -> None:
    import dataclasses

    from lattice_inference.mtp import MtpHead
    from lattice_inference.mtp.weights import _assemble

    _, cfg, tensors = moe
    raw = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
    emb = tensors[embed_name("qwen3_5_moe")]
    weights = _assemble(raw, "fused", cfg, emb, tensors["lm_head.weight"])
    MtpHead(cfg, weights)
    with pytest.raises(ModelLoadError, match=r"MTP weight lm_head has the wrong shape: expected \[160, 48\], actual"):
        MtpHead(cfg, dataclasses.replace(weights, lm_head=emb[:-1]))
    with pytest.raises(ModelLoadError, match=r"MTP weight q_norm is torch\.bfloat16"):
        MtpHead(cfg, dataclasses.replace(weights, q_norm=weights.q_norm.bfloat16()))
    with pytest.raises(ModelLoadError, match="MTP weight mlp_gate is missing"):
        MtpHead(dataclasses.replace(cfg, num_experts=0, intermediate_size=8), weights)
