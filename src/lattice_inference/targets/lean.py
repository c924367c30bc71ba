"""A lean forward for the Llama, Qwen2 and Qwen3 families: the model's own modules, none of its plumbing.

transformers' forward of a decoder wraps every step in machinery a decode step does not need: output-capturing
decorators, keyword routing, a mask built per call, a cache object's generic update path, per-layer wrappers.
On SmolLM2-135M that is several milliseconds of Python per step. `LeanTarget` runs the same computation from the
loaded model's own modules, in the same order and dtypes (embedding, rotary tables from the model's rotary
module, each layer's norms, projections (packed, decode-matched), q/k norms, ``apply_rotary_pos_emb``, the
cache write, transformers' ``sdpa`` attention call, the MLP, the final norm and the LM head), so its logits are
bit for bit those of ``model(...)``, and plain greedy decoding equals transformers' own. Everything else (cache,
rollback, draft trees, hidden states for MTP, decode-matched verification) is `TransformersTarget`'s.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lattice_inference.targets import decode_matched
from lattice_inference.targets.transformers import TransformersTarget

FORWARDS = ("auto", "lean", "transformers")
"""How a target runs the model: ``lean`` (`LeanTarget`), ``transformers`` (the model's own forward), ``auto`` (lean
where `lean_supported`)."""

LEAN_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})
"""``model_type`` values whose decoder `LeanTarget` runs (full attention only, rotary positions, RMSNorm)."""


def lean_supported(model: PreTrainedModel) -> str | None:
    """None where `LeanTarget` can run ``model``, else why not (one phrase)."""
    config = model.config
    if config.model_type not in LEAN_MODEL_TYPES:
        return f"model type {config.model_type!r} is not one of {sorted(LEAN_MODEL_TYPES)}"
    if getattr(config, "_attn_implementation", None) not in ("sdpa", decode_matched.ATTENTION):
        return f"attention implementation {config._attn_implementation!r} is not sdpa"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return "it has sliding-window layers"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    decoder = getattr(model, "model", None)
    if not all(hasattr(decoder, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "its decoder does not have the Llama layout"
    return None


class LeanTarget(TransformersTarget):
    """`TransformersTarget` whose forwards run the lean decoder loop (see the module docstring); only for models
    `lean_supported` accepts."""

    def __init__(self, model: PreTrainedModel, *, packed_weights: bool = True, decode_matched: bool = True) -> None:
        reason = lean_supported(model)
        if reason is not None:
            raise ValueError(f"the lean forward cannot run this model: {reason}")
        super().__init__(model, packed_weights=packed_weights, decode_matched=decode_matched)
        self._rotary = sys.modules[type(model).__module__].apply_rotary_pos_emb
        text = model.config
        self._head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads

    def _run(
        self,
        token_ids: Sequence[int],
        logits_to_keep: int,
        *,
        offsets: Sequence[int] | None = None,
        attention_mask: torch.Tensor | None = None,
        matched: bool = False,
    ) -> torch.Tensor:
        assert self._cache is not None
        n, start = len(token_ids), self._length
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        steps = range(n) if offsets is None else offsets
        positions = torch.tensor([[start + o for o in steps]], dtype=torch.long, device=self.device)
        mask = attention_mask
        if mask is None and 1 < n and start > 0 and not (matched and self.decode_matched):
            # rows at once over a cache: the causal mask transformers' sdpa_mask builds for this case
            mask = torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril(start)[None, None]
        matching = decode_matched.matching() if matched and self.decode_matched else contextlib.nullcontext()
        with torch.inference_mode(), matching:
            hidden = self._decoder(ids, positions, mask)
            logits = self.model.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        self._length += n
        return logits[0]

    def _decoder(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The decoder's hidden states after its final norm, ``[1, n, hidden]``, writing each layer's keys and
        values at the cache's current length."""
        decoder = self.model.model
        x = decoder.embed_tokens(ids)
        cos, sin = decoder.rotary_emb(x, positions)
        n, head_dim = ids.shape[1], self._head_dim
        attend = decode_matched.decode_matched_sdpa if decode_matched.active() else sdpa_attention_forward
        assert self._cache is not None
        for layer, cache in zip(decoder.layers, self._cache.layers, strict=True):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(1, n, -1, head_dim)
            k = attn.k_proj(h).view(1, n, -1, head_dim)
            v = attn.v_proj(h).view(1, n, -1, head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = self._rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            keys, values = cache.update(k, v)
            out, _ = attend(
                attn, q, keys, values, mask, dropout=0.0, scaling=attn.scaling,
                sliding_window=getattr(attn, "sliding_window", None),
            )  # fmt: skip
            x = x + attn.o_proj(out.reshape(1, n, -1).contiguous())
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return decoder.norm(x)
