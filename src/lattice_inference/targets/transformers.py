"""Adapter that turns any transformers ``AutoModelForCausalLM`` with an attention KV cache into a `Target`.

The cache is a ``DynamicCache`` with past recording switched on, so sliding-window layers keep enough history to
be cropped after a verification forward (transformers 5: ``crop`` takes a *negative* count of tokens to drop).
Models whose cache holds recurrent state (Gated DeltaNet, Mamba: Qwen3.5, Qwen3-Next, ...) cannot be rolled
back by cropping, so this adapter refuses them with `UnsupportedModelError` instead of producing wrong output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from lattice_inference.errors import TokenError, UnsupportedModelError


def recurrent_layer_count(model: PreTrainedModel) -> int:
    """Number of cache layers of ``model`` that hold recurrent (non-croppable) state."""
    cache = DynamicCache(config=model.config)
    return sum(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)


class TransformersTarget:
    """A `Target` over a transformers causal LM whose cache is attention KV only.

    ``forward`` passes explicit ``position_ids`` so that every token is fed at the position equal to its index;
    ``rollback`` crops every cache layer back to the accepted length.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        recurrent = recurrent_layer_count(model)
        if recurrent:
            raise UnsupportedModelError(
                f"model type {model.config.model_type!r} has {recurrent} recurrent-state cache layer(s) "
                "(linear attention / state space); their state cannot be rolled back by cropping the cache, "
                "so speculative decoding would not be lossless on it with this target"
            )
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self._vocab_size = int(model.get_input_embeddings().weight.shape[0])
        max_pos = getattr(model.config, "max_position_embeddings", None)
        self._max_positions = int(max_pos) if max_pos else None
        self._cache: DynamicCache | None = None
        self._length = 0

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_positions(self) -> int | None:
        return self._max_positions

    @property
    def length(self) -> int:
        return self._length

    def _check_ids(self, token_ids: Sequence[int]) -> None:
        for t in token_ids:
            if not 0 <= t < self._vocab_size:
                raise TokenError(f"token id {t} is outside the vocabulary of size {self._vocab_size}")

    def _run(self, token_ids: Sequence[int], logits_to_keep: int) -> torch.Tensor:
        assert self._cache is not None
        n = len(token_ids)
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        positions = torch.arange(self._length, self._length + n, device=self.device).unsqueeze(0)
        with torch.inference_mode():
            out = self.model(
                input_ids=ids,
                position_ids=positions,
                cache=self._cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
        self._length += n
        return out.logits[0]

    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor:
        if not token_ids:
            raise TokenError("cannot prefill an empty prompt: at least one token is needed")
        self._check_ids(token_ids)
        self._cache = DynamicCache(config=self.model.config)
        self._cache.activate_past_recording()
        self._length = 0
        logits = self._run(token_ids, logits_to_keep=1)[-1]
        self._cache.crop(0)  # bound sliding-window layers back to their window
        return logits

    def forward(self, token_ids: Sequence[int]) -> torch.Tensor:
        if self._cache is None:
            raise RuntimeError("forward() called before prefill()")
        if not token_ids:
            raise TokenError("forward() needs at least one token")
        self._check_ids(token_ids)
        return self._run(token_ids, logits_to_keep=0)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot roll back to length {length}: the cache holds {self._length} tokens")
        if self._cache is None:
            return
        self._cache.crop(length - self._length)
        self._length = length
