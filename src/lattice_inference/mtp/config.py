"""Configuration of the Qwen3-Next / Qwen3.5 multi-token-prediction (MTP) head.

``MtpConfig`` carries the fields of the reference module's ``MtpConfig`` (same names, same defaults, which are
those of ``Qwen3_5MoeTextConfig`` plus ``rope_theta = 1e7``) and the few extra fields a faithful port needs
(``norm_topk_prob``, the dense MLP width, ``tie_word_embeddings``). ``MtpConfig.from_hf_config`` builds it from a
model's ``config.json``: flat for Qwen3-Next and the ``*_text`` types, nested under ``text_config`` for the
Qwen3.5 (VL) wrappers. Keys missing from the file take the defaults of transformers' own config class for that
model type, because that is what the target trunk loaded by transformers uses; the MTP must agree with it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lattice_inference.errors import ConfigError
from lattice_inference.hybrid_families import (
    HYBRID_MODEL_TYPES,
    HYBRID_TEXT_MODEL_TYPES,
    is_hybrid_model_type,
    text_config_is_nested,
)
from lattice_inference.options import MAX_DRAFT_LENGTH, MIN_DRAFT_LENGTH

#: Key holding the number of MTP layers, per text model type (vLLM ``hf_config_override``).
_MTP_LAYERS_KEY = {
    "qwen3_next": "num_nextn_predict_layers",
    "qwen3_5_text": "mtp_num_hidden_layers",
    "qwen3_5_moe_text": "mtp_num_hidden_layers",
}


@dataclasses.dataclass(frozen=True)
class MtpConfig:
    """Shapes and hyper-parameters of one MTP head.

    ``draft_length`` is the reference's runtime setting: the number of tokens per speculative step **including**
    the target's own next token, so ``draft_length - 1`` MTP forwards draft per step (2..8, default 4).
    ``num_experts == 0`` means a dense SwiGLU MLP of width ``intermediate_size`` (dense Qwen3.5 models).
    """

    draft_length: int = 4
    num_hidden_layers: int = 1
    hidden_size: int = 2048
    vocab_size: int = 248_320
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    use_dedicated_embeddings: bool = False
    norm_topk_prob: bool = True
    intermediate_size: int | None = None
    tie_word_embeddings: bool = False
    model_type: str = "qwen3_5_moe_text"

    def __post_init__(self) -> None:
        self.validate()

    @property
    def rotary_dim(self) -> int:
        """Number of leading head dims that RoPE rotates: ``int(head_dim * partial_rotary_factor)``."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_moe(self) -> bool:
        """True when the MTP layer's MLP is a sparse MoE block (``num_experts > 0``)."""
        return self.num_experts > 0

    @property
    def num_drafts(self) -> int:
        """MTP forwards per speculative step: ``draft_length - 1``."""
        return self.draft_length - 1

    def validate(self) -> None:
        """Raise ``ConfigError`` for any unsupported or inconsistent setting (checked in the reference's order)."""
        if self.num_hidden_layers != 1:
            raise ConfigError(f"MTP num_hidden_layers other than 1 is not implemented (got {self.num_hidden_layers})")
        if self.use_dedicated_embeddings:
            raise ConfigError("dedicated MTP embeddings are not implemented (mtp_use_dedicated_embeddings is true)")
        if self.draft_length > MAX_DRAFT_LENGTH:
            raise ConfigError(
                f"MTP draft_length > {MAX_DRAFT_LENGTH} is not benchmarked or supported "
                f"(got {self.draft_length}; it counts the target token, so at most {MAX_DRAFT_LENGTH - 1} drafts)"
            )
        if self.draft_length < MIN_DRAFT_LENGTH:
            raise ConfigError(
                f"MTP draft_length must be at least {MIN_DRAFT_LENGTH} (got {self.draft_length}): it counts the "
                "target token, so a smaller value drafts nothing; use plain decoding instead"
            )
        for name in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"MTP {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by num_key_value_heads "
                f"{self.num_key_value_heads}"
            )
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        rotary_dim = self.rotary_dim
        if rotary_dim <= 0 or rotary_dim % 2 != 0:
            raise ConfigError(
                f"rotary dim int(head_dim {self.head_dim} * partial_rotary_factor {self.partial_rotary_factor})"
                f" = {rotary_dim} must be even and positive"
            )
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.num_experts < 0:
            raise ConfigError(f"num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts > 0:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                    f"got {self.num_experts_per_tok}"
                )
            for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
                if getattr(self, name) <= 0:
                    raise ConfigError(f"MTP {name} must be positive for a MoE head, got {getattr(self, name)}")
        elif self.intermediate_size is None or self.intermediate_size <= 0:
            raise ConfigError(
                f"a dense MTP head (num_experts == 0) needs a positive intermediate_size, got {self.intermediate_size}"
            )

    def with_draft_length(self, draft_length: int) -> MtpConfig:
        """Return a copy with another ``draft_length`` (validated)."""
        return dataclasses.replace(self, draft_length=draft_length)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | Path | Any, *, draft_length: int = 4) -> MtpConfig:
        """Build the config from a transformers ``config.json``.

        ``config`` is the parsed dict, a path to ``config.json`` or to the model directory, or a transformers
        ``PreTrainedConfig`` (converted with ``to_dict()``). Flat Qwen3-Next / ``*_text`` configs and nested
        Qwen3.5 ``text_config`` are accepted; RoPE settings are read from ``rope_parameters`` (transformers 5)
        or the legacy top-level ``rope_theta`` / ``partial_rotary_factor``.
        """
        raw = _as_dict(config)
        model_type = raw.get("model_type")
        if not is_hybrid_model_type(model_type):
            raise ConfigError(
                f"model_type {model_type!r} has no supported MTP head; expected one of {sorted(HYBRID_MODEL_TYPES)}"
            )
        text_type = HYBRID_TEXT_MODEL_TYPES[model_type]
        nested = text_config_is_nested(model_type)
        text = raw
        if nested:
            text = raw.get("text_config") or {}
            if not isinstance(text, Mapping):
                raise ConfigError(f"text_config of a {model_type} config must be a mapping, got {type(text)}")
        defaults = _class_defaults(text_type)

        def get(key: str, fallback: Any = None) -> Any:
            if key in text and text[key] is not None:
                return text[key]
            return defaults.get(key, fallback)

        rope_theta, partial = _rope_settings(text, defaults)
        layers_key = _MTP_LAYERS_KEY[text_type]
        num_layers = text.get(layers_key)
        if num_layers is None and nested:
            num_layers = raw.get(layers_key)
        num_layers = 1 if num_layers is None else num_layers  # vLLM: getattr(config, key, 1)
        tie = bool(get("tie_word_embeddings", False))
        if nested and raw.get("tie_word_embeddings"):
            tie = True  # the VL wrapper's flag governs the wrapper's lm_head
        if text.get("attention_bias"):
            raise ConfigError("attention_bias = true is not supported by the MTP head (no released model uses it)")
        num_experts = int(get("num_experts", 0) or 0)
        try:
            return cls(
                draft_length=draft_length,
                num_hidden_layers=int(num_layers),
                hidden_size=int(get("hidden_size")),
                vocab_size=int(get("vocab_size")),
                num_attention_heads=int(get("num_attention_heads")),
                num_key_value_heads=int(get("num_key_value_heads")),
                head_dim=int(get("head_dim") or int(get("hidden_size")) // int(get("num_attention_heads"))),
                rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                partial_rotary_factor=float(partial),
                num_experts=num_experts,
                num_experts_per_tok=int(get("num_experts_per_tok", 0) or 0),
                moe_intermediate_size=int(get("moe_intermediate_size", 0) or 0),
                shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 0) or 0),
                use_dedicated_embeddings=bool(
                    text.get("mtp_use_dedicated_embeddings") or (nested and raw.get("mtp_use_dedicated_embeddings"))
                ),
                norm_topk_prob=bool(get("norm_topk_prob", True)),
                intermediate_size=None if get("intermediate_size") is None else int(get("intermediate_size")),
                tie_word_embeddings=tie,
                model_type=text_type,
            )
        except (TypeError, ZeroDivisionError) as exc:
            raise ConfigError(f"invalid {model_type} config for the MTP head: {exc}") from exc


def _as_dict(config: Mapping[str, Any] | str | Path | Any) -> dict[str, Any]:
    """Return ``config`` as a plain dict (reading ``config.json`` when given a path)."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"no config.json at {path}") from exc
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path} does not hold a JSON object")
        return data
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    raise ConfigError(f"expected a config dict, a path or a transformers config, got {type(config).__name__}")


def _rope_settings(text: Mapping[str, Any], defaults: Mapping[str, Any]) -> tuple[float, float]:
    """Return ``(rope_theta, partial_rotary_factor)`` with transformers' precedence.

    transformers 5 keeps both under ``rope_parameters`` (``standardize_rope_params``); older files keep them at the
    top level. ``rope_parameters`` wins, then the top level, then the class default (``default_theta`` = 1e4 and the
    Qwen classes' ``partial_rotary_factor`` = 0.25). Only ``rope_type == "default"`` (plus text-only M-RoPE, which
    reduces to 1-D RoPE) is supported.
    """
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"rope_parameters must be a mapping, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope_type {rope_type!r} is not supported by the MTP head (only 'default')")
    default_params = defaults.get("rope_parameters") or {}
    theta = params.get("rope_theta", text.get("rope_theta", default_params.get("rope_theta", 10_000.0)))
    partial = params.get(
        "partial_rotary_factor",
        text.get("partial_rotary_factor", default_params.get("partial_rotary_factor", 0.25)),
    )
    return float(theta), float(partial)


@functools.lru_cache(maxsize=8)
def _class_defaults(text_model_type: str) -> dict[str, Any]:
    """Defaults of transformers' config class for ``text_model_type`` (what the trunk would use)."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[text_model_type]().to_dict()
