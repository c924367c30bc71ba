"""Targets: the model being accelerated, behind the `Target` protocol."""

from __future__ import annotations

from transformers import PreTrainedModel

from lattice_inference.errors import ConfigError
from lattice_inference.options import (
    FORWARDS,
    PREFIX_BUDGET,
    PROMPT_CACHE_SIZE,
    TargetOptions,
    check_forward,
    check_kv_cache,
    check_kv_slots,
)
from lattice_inference.targets.base import Target
from lattice_inference.targets.hybrid import HybridTarget, is_hybrid
from lattice_inference.targets.lean import LeanTarget, lean_supported
from lattice_inference.targets.transformers import TransformersTarget

__all__ = ["FORWARDS", "HybridTarget", "LeanTarget", "Target", "TransformersTarget", "make_target", "target_for"]


def make_target(
    model: PreTrainedModel,
    *,
    packed_weights: bool = True,
    decode_matched: bool = True,
    forward: str = "auto",
    prefix_cache: bool = True,
    prefix_budget: int | None = PREFIX_BUDGET,
    kv_cache: str = "auto",
    kv_slots: int = 0,
    prompt_cache: str | None = None,
    prompt_cache_size: int = PROMPT_CACHE_SIZE,
) -> Target:
    """The right `Target` for ``model``: Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next) get `HybridTarget`, whose
    rollback restores recurrent state exactly; attention-cache models get `TransformersTarget`; anything else
    with recurrent state is refused with `UnsupportedModelError`. ``packed_weights``, ``decode_matched``: see
    `CausalLMTarget`; ``forward``: one of `FORWARDS` (``lean`` for a model it does not run is a `ConfigError`);
    ``prefix_cache``, ``prefix_budget``, ``kv_cache``, ``kv_slots``, ``prompt_cache``: see `LeanTarget` (the only
    target that reuses a prompt's cached rows, and the only one whose cache may be float16, preallocated or saved:
    ``kv_cache="float16"``, ``kv_slots`` or ``prompt_cache`` elsewhere is a `ConfigError`)."""
    check_forward(forward)
    check_kv_cache(kv_cache)
    check_kv_slots(kv_slots)
    if is_hybrid(model):
        if forward == "lean":
            raise ConfigError("the lean forward runs Llama, Qwen2 and Qwen3 models, not Gated DeltaNet hybrids")
        _model_cache_only(kv_cache, kv_slots, prompt_cache, "Gated DeltaNet hybrids run on HybridTarget")
        return HybridTarget(model, packed_weights=packed_weights, decode_matched=decode_matched)
    if forward == "lean" or (forward == "auto" and lean_supported(model) is None):
        return LeanTarget(  # says why not
            model,
            packed_weights=packed_weights,
            decode_matched=decode_matched,
            prefix_cache=prefix_cache,
            prefix_budget=prefix_budget,
            kv_cache=kv_cache,
            kv_slots=kv_slots,
            prompt_cache=prompt_cache,
            prompt_cache_size=prompt_cache_size,
        )
    why = f"this model runs on transformers' forward ({lean_supported(model) or 'as asked'})"
    _model_cache_only(kv_cache, kv_slots, prompt_cache, why)
    return TransformersTarget(model, packed_weights=packed_weights, decode_matched=decode_matched)


def target_for(model: PreTrainedModel, options: TargetOptions) -> Target:
    """`make_target` for ``options``: where a `Generator` and the server build their targets (one place)."""
    return make_target(
        model,
        decode_matched=options.decode_matched,
        forward=options.forward,
        prefix_cache=options.prefix_cache,
        prefix_budget=options.prefix_budget,
        kv_cache=options.kv_cache,
        kv_slots=options.kv_slots,
        prompt_cache=options.prompt_cache,
        prompt_cache_size=options.prompt_cache_size,
    )


def _model_cache_only(kv_cache: str, kv_slots: int, prompt_cache: str | None, why: str) -> None:
    """A `ConfigError` where ``kv_cache`` asks for a float16 cache, ``kv_slots`` for preallocated ones, or
    ``prompt_cache`` for saved ones, of a target whose caches are transformers' own."""
    if prompt_cache:
        raise ConfigError(f"--prompt-cache needs the lean forward (its rows are the same at any length); {why}")
    if kv_cache == "float16":
        raise ConfigError(f"kv_cache float16 needs the lean forward's native ops; {why}")
    if kv_slots:
        raise ConfigError(f"kv_slots needs the lean forward; {why}")
