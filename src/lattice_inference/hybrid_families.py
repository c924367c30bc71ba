"""The Gated DeltaNet hybrid model families (Qwen3-Next, Qwen3.5, Qwen3.5-MoE), named by transformers ``model_type``.

One table for everything that recognises these models: the hybrid target (`targets.hybrid`), the MTP head's
config reader (`mtp.config`) and MTP training's norm conversion (`train.model`).
"""

from __future__ import annotations

from typing import TypeGuard

HYBRID_TEXT_MODEL_TYPES: dict[str, str] = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_text": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen3_5_moe_text": "qwen3_5_moe_text",
}
"""``model_type`` of a hybrid config -> ``model_type`` of its text config. They differ for the Qwen3.5 (VL)
wrappers, whose text config is nested under ``text_config``; Qwen3-Next and the ``*_text`` types are flat."""

HYBRID_MODEL_TYPES = frozenset(HYBRID_TEXT_MODEL_TYPES)
"""Every hybrid ``model_type``, top-level or of a text config."""


def is_hybrid_model_type(model_type: object) -> TypeGuard[str]:
    """Whether ``model_type`` (a config's, top-level or of its text config) names a hybrid family."""
    return isinstance(model_type, str) and model_type in HYBRID_MODEL_TYPES


def text_config_is_nested(model_type: str) -> bool:
    """Whether a config of the hybrid ``model_type`` nests its text config under ``text_config``."""
    return HYBRID_TEXT_MODEL_TYPES[model_type] != model_type
