"""Targets: the model being accelerated, behind the `Target` protocol."""

from __future__ import annotations

from transformers import PreTrainedModel

from lattice_inference.targets.base import Target
from lattice_inference.targets.transformers import TransformersTarget

__all__ = ["Target", "TransformersTarget", "make_target"]


def make_target(model: PreTrainedModel) -> Target:
    """The right `Target` for ``model``: attention-cache models get `TransformersTarget`."""
    return TransformersTarget(model)
