"""Targets: the model being accelerated, behind the `Target` protocol."""

from __future__ import annotations

from transformers import PreTrainedModel

from lattice_inference.targets.base import Target
from lattice_inference.targets.hybrid import HybridTarget, is_hybrid
from lattice_inference.targets.transformers import TransformersTarget

__all__ = ["HybridTarget", "Target", "TransformersTarget", "make_target"]


def make_target(model: PreTrainedModel, *, packed_weights: bool = True, decode_matched: bool = True) -> Target:
    """The right `Target` for ``model``: Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next) get `HybridTarget`, whose
    rollback restores recurrent state exactly; attention-cache models get `TransformersTarget`; anything else
    with recurrent state is refused with `UnsupportedModelError`. ``packed_weights``, ``decode_matched``: see
    `CausalLMTarget`."""
    if is_hybrid(model):
        return HybridTarget(model, packed_weights=packed_weights, decode_matched=decode_matched)
    return TransformersTarget(model, packed_weights=packed_weights, decode_matched=decode_matched)
