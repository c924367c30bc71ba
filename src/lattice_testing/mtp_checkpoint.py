"""Tiny random MTP checkpoints for tests and benchmarks (no download, no trunk layers).

A checkpoint here is a directory with a transformers ``config.json`` (from the model family's own config class) and
safetensors holding the trunk's embedding and ``lm_head`` plus every ``mtp.*`` tensor of the head, laid out as a
released checkpoint would be (fused experts, per-expert tensors or a dense MLP). Weights are random with a
configurable std, and the ``(1 + w)`` norm weights are random too, so that numeric mistakes show.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lattice_inference.mtp.config import MtpConfig
from lattice_inference.mtp.weights import DENSE, FUSED, PER_EXPERT

FAMILIES = ("qwen3_next", "qwen3_5_moe", "qwen3_5")


def tiny_hf_config(family: str, **text_overrides: Any) -> Any:
    """A tiny transformers config of ``family`` (``qwen3_next`` flat, ``qwen3_5_moe`` / ``qwen3_5`` nested).

    Defaults: hidden 48, 4 heads / 2 kv heads of 16 dims (rotary dim 8), vocab 160; MoE 6 experts top-2 of width 16
    with a shared expert of width 24; dense width 40; one MTP layer.
    """
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3NextConfig

    text: dict[str, Any] = {
        "vocab_size": 160,
        "hidden_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
    }
    moe = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
    dense_width = 40
    if family == "qwen3_next":
        text.update(moe, intermediate_size=dense_width, num_nextn_predict_layers=1)
        text.update(text_overrides)
        return Qwen3NextConfig(**text)
    text["mtp_num_hidden_layers"] = 1
    text["mtp_use_dedicated_embeddings"] = False
    if family == "qwen3_5_moe":
        text.update(moe)
        text.update(text_overrides)
        return Qwen3_5MoeConfig(text_config=text, tie_word_embeddings=bool(text.get("tie_word_embeddings")))
    if family == "qwen3_5":
        text.update(intermediate_size=dense_width, tie_word_embeddings=True)
        text.update(text_overrides)
        return Qwen3_5Config(text_config=text, tie_word_embeddings=bool(text.get("tie_word_embeddings")))
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def embed_name(family: str) -> str:
    """Checkpoint name of the trunk embedding for ``family`` (VL wrappers nest it under ``language_model``)."""
    return "model.embed_tokens.weight" if family == "qwen3_next" else "model.language_model.embed_tokens.weight"


def random_mtp_tensors(
    cfg: MtpConfig, family: str, *, std: float = 0.3, seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Random checkpoint tensors (fused expert layout for MoE) with checkpoint names, trunk embed and lm_head."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = std) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    h, hd, p = cfg.hidden_size, cfg.head_dim, "mtp.layers.0."
    t: dict[str, torch.Tensor] = {
        embed_name(family): rnd(cfg.vocab_size, h, scale=1.0),
        "mtp.fc.weight": rnd(h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": rnd(h),
        "mtp.pre_fc_norm_hidden.weight": rnd(h),
        "mtp.norm.weight": rnd(h),
        p + "input_layernorm.weight": rnd(h),
        p + "post_attention_layernorm.weight": rnd(h),
        p + "self_attn.q_proj.weight": rnd(2 * cfg.num_attention_heads * hd, h),
        p + "self_attn.k_proj.weight": rnd(cfg.num_key_value_heads * hd, h),
        p + "self_attn.v_proj.weight": rnd(cfg.num_key_value_heads * hd, h),
        p + "self_attn.o_proj.weight": rnd(h, cfg.num_attention_heads * hd),
        p + "self_attn.q_norm.weight": rnd(hd),
        p + "self_attn.k_norm.weight": rnd(hd),
    }
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = rnd(cfg.vocab_size, h)
    if cfg.is_moe:
        e, i, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        t.update(
            {
                p + "mlp.gate.weight": rnd(e, h, scale=1.0),
                p + "mlp.experts.gate_up_proj": rnd(e, 2 * i, h),
                p + "mlp.experts.down_proj": rnd(e, h, i),
                p + "mlp.shared_expert.gate_proj.weight": rnd(s, h),
                p + "mlp.shared_expert.up_proj.weight": rnd(s, h),
                p + "mlp.shared_expert.down_proj.weight": rnd(h, s),
                p + "mlp.shared_expert_gate.weight": rnd(1, h),
            }
        )
    else:
        i = int(cfg.intermediate_size or 0)
        t.update(
            {
                p + "mlp.gate_proj.weight": rnd(i, h),
                p + "mlp.up_proj.weight": rnd(i, h),
                p + "mlp.down_proj.weight": rnd(h, i),
            }
        )
    return t


def to_per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rewrite fused expert tensors as one tensor per expert (``experts.{e}.{gate,up,down}_proj.weight``)."""
    p = "mtp.layers.0.mlp.experts."
    out = {k: v for k, v in tensors.items() if not k.startswith(p)}
    gate_up, down = tensors[p + "gate_up_proj"], tensors[p + "down_proj"]
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        out[f"{p}{e}.gate_proj.weight"] = gate_up[e, :inter].contiguous()
        out[f"{p}{e}.up_proj.weight"] = gate_up[e, inter:].contiguous()
        out[f"{p}{e}.down_proj.weight"] = down[e].contiguous()
    return out


def write_checkpoint(
    model_dir: str | Path, hf_config: Any, tensors: dict[str, torch.Tensor], *, shards: int = 1
) -> Path:
    """Write ``config.json`` and the tensors (one ``model.safetensors`` or ``shards`` files plus an index)."""
    root = Path(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    config = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    (root / "config.json").write_text(json.dumps(config, indent=1))
    tensors = {k: v.detach().clone().contiguous() for k, v in tensors.items()}
    if shards <= 1:
        save_file(tensors, str(root / "model.safetensors"))
        return root
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(root / file))
        weight_map.update(dict.fromkeys(part, file))
    index: dict[str, Any] = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in tensors.values())}}
    index["weight_map"] = weight_map
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return root


def build_tiny_checkpoint(
    model_dir: str | Path,
    family: str,
    *,
    layout: str | None = None,
    std: float = 0.3,
    seed: int = 0,
    shards: int = 1,
    dtype: torch.dtype = torch.float32,
    **text_overrides: Any,
) -> tuple[Path, MtpConfig, dict[str, torch.Tensor]]:
    """Write a tiny random checkpoint of ``family``; returns (dir, its MtpConfig, the fused-layout tensors)."""
    hf = tiny_hf_config(family, **text_overrides)
    cfg = MtpConfig.from_hf_config(hf.to_dict())
    layout = layout or (DENSE if not cfg.is_moe else PER_EXPERT if family == "qwen3_next" else FUSED)
    tensors = random_mtp_tensors(cfg, family, std=std, seed=seed, dtype=dtype)
    stored = to_per_expert(tensors) if layout == PER_EXPERT else tensors
    return write_checkpoint(model_dir, hf, stored, shards=shards), cfg, tensors
