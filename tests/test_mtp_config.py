"""MtpConfig: reference defaults, construction from config.json (flat and nested), validation errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lattice_inference.errors import ConfigError
from lattice_inference.mtp import MtpConfig
from lattice_testing.mtp_checkpoint import tiny_hf_config

# Abridged config.json of Qwen3-Next-80B-A3B as released (legacy top-level RoPE keys, flat).
QWEN3_NEXT_JSON = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
    "intermediate_size": 5120,
}

# Abridged config.json of a Qwen3.5 MoE VL release (nested text_config, transformers-5 rope_parameters).
QWEN3_5_MOE_JSON = {
    "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "vocab_size": 248320,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    },
}


def test_defaults_are_the_reference_defaults() -> None:
    cfg = MtpConfig()
    assert (cfg.draft_length, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (4, 1, 2048, 248_320)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (16, 2, 256)
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.partial_rotary_factor) == (1e-6, 1e7, 0.25)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (256, 8, 512)
    assert cfg.shared_expert_intermediate_size == 512 and cfg.use_dedicated_embeddings is False
    assert cfg.rotary_dim == 64 and cfg.num_drafts == 3 and cfg.is_moe
    assert cfg.with_draft_length(2).num_drafts == 1


def test_flat_qwen3_next_release_config() -> None:
    cfg = MtpConfig.from_hf_config(QWEN3_NEXT_JSON)
    assert cfg.model_type == "qwen3_next" and cfg.vocab_size == 151936
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (512, 10, True)
    assert (cfg.rope_theta, cfg.partial_rotary_factor, cfg.rotary_dim) == (1e7, 0.25, 64)
    assert cfg.num_hidden_layers == 1  # num_nextn_predict_layers absent -> 1 (vLLM)
    assert not cfg.tie_word_embeddings


def test_nested_qwen3_5_moe_release_config(tmp_path: Path) -> None:
    cfg = MtpConfig.from_hf_config(QWEN3_5_MOE_JSON, draft_length=8)
    assert cfg.model_type == "qwen3_5_moe_text" and cfg.vocab_size == 248320 and cfg.draft_length == 8
    assert (cfg.rope_theta, cfg.rotary_dim, cfg.num_experts, cfg.num_experts_per_tok) == (1e7, 64, 256, 8)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_5_MOE_JSON))
    assert MtpConfig.from_hf_config(tmp_path, draft_length=8) == cfg
    assert MtpConfig.from_hf_config(tmp_path / "config.json", draft_length=8) == cfg
    assert MtpConfig.from_hf_config(str(tmp_path), draft_length=8) == cfg


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "qwen3_5"])
def test_agrees_with_transformers_config_classes(family: str) -> None:
    """RoPE and shapes as transformers' own config classes standardise them (rope_parameters in v5)."""
    hf = tiny_hf_config(family, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    text = hf.get_text_config()
    for source in (hf, hf.to_dict()):
        cfg = MtpConfig.from_hf_config(source)
        assert cfg.rope_theta == text.rope_parameters["rope_theta"] == 5e5
        assert cfg.partial_rotary_factor == text.rope_parameters["partial_rotary_factor"] == 0.25  # class default
        assert (cfg.hidden_size, cfg.head_dim, cfg.vocab_size) == (text.hidden_size, text.head_dim, text.vocab_size)
        assert cfg.num_experts == getattr(text, "num_experts", 0)
    assert MtpConfig.from_hf_config(hf).tie_word_embeddings == (family == "qwen3_5")


def test_flat_text_model_types_and_missing_keys_take_class_defaults() -> None:
    cfg = MtpConfig.from_hf_config({"model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1})
    assert not cfg.is_moe and cfg.intermediate_size == 12288 and cfg.hidden_size == 4096
    assert cfg.rope_theta == 10_000.0  # transformers' default_theta when the file has none
    cfg = MtpConfig.from_hf_config({"model_type": "qwen3_5_moe_text"})
    assert cfg.is_moe and (cfg.num_experts, cfg.num_experts_per_tok) == (256, 8)
    nested_tie = {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": {"hidden_size": 64}}
    assert MtpConfig.from_hf_config(nested_tie).tie_word_embeddings


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"num_nextn_predict_layers": 2}, "num_hidden_layers other than 1"),
        ({"num_nextn_predict_layers": 0}, "num_hidden_layers other than 1"),
        ({"num_attention_heads": 6, "num_key_value_heads": 4}, "not divisible by num_key_value_heads 4"),
        ({"partial_rotary_factor": 0.125, "head_dim": 40}, "must be even"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not supported"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_experts_per_tok": 600}, "num_experts_per_tok must be in"),
        ({"num_experts": 0, "intermediate_size": 0}, "needs a positive intermediate_size"),
        ({"model_type": "llama"}, "model_type 'llama' has no supported MTP head"),
    ],
)
def test_flat_config_errors(edit: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        MtpConfig.from_hf_config(QWEN3_NEXT_JSON | edit)


def test_nested_config_errors() -> None:
    def nested(**text):
        return QWEN3_5_MOE_JSON | {"text_config": QWEN3_5_MOE_JSON["text_config"] | text}

    with pytest.raises(ConfigError, match="dedicated MTP embeddings are not implemented"):
        MtpConfig.from_hf_config(nested(mtp_use_dedicated_embeddings=True))
    with pytest.raises(ConfigError, match="dedicated MTP embeddings"):
        MtpConfig.from_hf_config(QWEN3_5_MOE_JSON | {"mtp_use_dedicated_embeddings": True})
    with pytest.raises(ConfigError, match="num_hidden_layers other than 1"):
        MtpConfig.from_hf_config(nested(mtp_num_hidden_layers=2))
    with pytest.raises(ConfigError, match="num_hidden_layers other than 1"):
        MtpConfig.from_hf_config(QWEN3_5_MOE_JSON | {"mtp_num_hidden_layers": 3, "text_config": {}})
    with pytest.raises(ConfigError, match="text_config"):
        MtpConfig.from_hf_config(QWEN3_5_MOE_JSON | {"text_config": [1]})


@pytest.mark.parametrize(("length", "message"), [(9, r"draft_length > 8"), (1, "at least 2"), (0, "at least 2")])
def test_draft_length_bounds(length: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        MtpConfig(draft_length=length)
    with pytest.raises(ConfigError, match=message):
        MtpConfig.from_hf_config(QWEN3_NEXT_JSON, draft_length=length)
    assert MtpConfig(draft_length=8).num_drafts == 7


def test_direct_construction_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="num_key_value_heads must be a positive integer"):
        MtpConfig(num_key_value_heads=0)
    with pytest.raises(ConfigError, match="rotary dim"):
        MtpConfig(head_dim=10, partial_rotary_factor=0.5)  # 5
    with pytest.raises(ConfigError, match="dedicated"):
        MtpConfig(use_dedicated_embeddings=True)
    with pytest.raises(ConfigError, match=r"no config\.json"):
        MtpConfig.from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        MtpConfig.from_hf_config(tmp_path)
    with pytest.raises(ConfigError, match="expected a config dict"):
        MtpConfig.from_hf_config(42)
