"""Targets: the model being accelerated, behind the `Target` protocol."""

from __future__ import annotations

from transformers import PreTrainedModel

from lattice_inference.errors import ConfigError
from lattice_inference.options import FORWARDS, PREFIX_BUDGET, check_forward
from lattice_inference.targets.base import Target
from lattice_inference.targets.hybrid import HybridTarget, is_hybrid
from lattice_inference.targets.lean import LeanTarget, lean_supported
from lattice_inference.targets.transformers import TransformersTarget

__all__ = ["FORWARDS", "HybridTarget", "LeanTarget", "Target", "TransformersTarget", "make_target"]


def make_target(
    model: PreTrainedModel,
    *,
    packed_weights: bool = True,
    decode_matched: bool = True,
    forward: str = "auto",
    prefix_cache: bool = True,
    prefix_budget: int = PREFIX_BUDGET,
) -> Target:
    """The right `Target` for ``model``: Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next) get `HybridTarget`, whose
    rollback restores recurrent state exactly; attention-cache models get `TransformersTarget`; anything else
    with recurrent state is refused with `UnsupportedModelError`. ``packed_weights``, ``decode_matched``: see
    `CausalLMTarget`; ``forward``: one of `FORWARDS` (``lean`` for a model it does not run is a `ConfigError`);
    ``prefix_cache``, ``prefix_budget``: see `LeanTarget` (the only target that reuses a prompt's cached rows)."""
    check_forward(forward)
    if is_hybrid(model):
        if forward == "lean":
            raise ConfigError("the lean forward runs Llama, Qwen2 and Qwen3 models, not Gated DeltaNet hybrids")
        return HybridTarget(model, packed_weights=packed_weights, decode_matched=decode_matched)
    if forward == "lean" or (forward == "auto" and lean_supported(model) is None):
        return LeanTarget(  # says why not
            model,
            packed_weights=packed_weights,
            decode_matched=decode_matched,
            prefix_cache=prefix_cache,
            prefix_budget=prefix_budget,
        )
    return TransformersTarget(model, packed_weights=packed_weights, decode_matched=decode_matched)
