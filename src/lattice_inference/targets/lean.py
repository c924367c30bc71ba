"""A lean forward for the Llama, Qwen2 and Qwen3 families: the model's own modules, none of its plumbing.

transformers' forward of a decoder wraps every step in machinery a decode step does not need: output-capturing
decorators, keyword routing, a mask built per call, a cache object's generic update path, per-layer wrappers.
On a model as small as SmolLM2-135M that Python is a large share of each step. `LeanTarget` runs the same
computation from the loaded model's own modules and weights (no copy beyond the packed weights `packed_linear`
keeps): embedding, rotary tables from the model's rotary module, each layer's norms, projections (packed, fused,
decode-matched), q/k norms, ``apply_rotary_pos_emb``, the cache write (a position-indexed buffer:
`kv_cache.GrowableLayer`, rollback = set the length), attention, the MLP, the final norm and the LM head.

Attention: a prefill, and every forward without decode matching, makes transformers' own ``sdpa`` call, so those
logits are the model forward's bit for bit. With decode matching (the default), every forward after the prefill,
the 1-token step included, runs `block_attention`: fixed-shape float32 blocks in which each row is computed the
same way at any width, so a 16-token verification costs one or a few attention calls per layer instead of 16,
and its rows equal the 1-token steps bitwise (`check_exactness` confirms it at load). Its logits then agree with
the model forward's to float32 rounding of the attention (plain greedy decoding in float32 equals transformers'
on the real model and the toys). Cache, rollback, draft trees and hidden states for MTP are `TransformersTarget`'s.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lattice_inference.errors import ConfigError
from lattice_inference.targets import decode_matched
from lattice_inference.targets.block_attention import Block, block_attention, plan_blocks
from lattice_inference.targets.decode_matched import Product
from lattice_inference.targets.packed_linear import products
from lattice_inference.targets.transformers import TransformersTarget

FORWARDS = ("auto", "lean", "transformers")
"""How a target runs the model: ``lean`` (`LeanTarget`), ``transformers`` (the model's own forward), ``auto`` (lean
where `lean_supported`)."""


def check_forward(forward: str) -> None:
    """``forward`` must be one of `FORWARDS`."""
    if forward not in FORWARDS:
        raise ConfigError(f"forward must be one of {', '.join(FORWARDS)}, got {forward!r}")


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
            raise ConfigError(f"the lean forward cannot run this model: {reason}")
        super().__init__(model, packed_weights=packed_weights, decode_matched=decode_matched)
        self._rotary = sys.modules[type(model).__module__].apply_rotary_pos_emb
        self._layers = [_Layer.of(layer) for layer in model.model.layers]
        text = model.config
        self._head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self._groups = text.num_attention_heads // text.num_key_value_heads

    def _logits(
        self, ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor | None, logits_to_keep: int
    ) -> torch.Tensor:
        n, start = ids.shape[1], self._length
        mask = attention_mask
        blocks = None
        if decode_matched.active():
            blocks = plan_blocks(start, n, None if mask is None else _seen_rows(mask, start), self._groups, self.device)
        elif mask is None and 1 < n and start > 0:
            # rows at once over a cache: the causal mask transformers' sdpa_mask builds for this case
            mask = torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril(start)[None, None]
        hidden = self._decoder(ids, positions, mask, blocks)
        return self.model.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)

    def _decoder(
        self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, blocks: list[Block] | None
    ) -> torch.Tensor:
        """The decoder's hidden states after its final norm, ``[1, n, hidden]``, writing each layer's keys and
        values at the cache's current length; attention by ``blocks`` (`block_attention`) where given, else
        transformers' ``sdpa`` call under ``mask``."""
        decoder = self.model.model
        x = decoder.embed_tokens(ids)
        cos, sin = decoder.rotary_emb(x, positions)
        n, head_dim = ids.shape[1], self._head_dim
        span = 0 if blocks is None else max(block.reach for block in blocks)
        assert self._cache is not None
        for layer, cache in zip(self._layers, self._cache.layers, strict=True):
            attn = layer.attn
            h = layer.input_norm(x)
            q, k, v = _run_products(layer.qkv, h)
            q, k, v = q.view(1, n, -1, head_dim), k.view(1, n, -1, head_dim), v.view(1, n, -1, head_dim)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = self._rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            keys, values = cache.update(k, v.transpose(1, 2))
            if blocks is not None:
                out = block_attention(q, *cache.buffers(span), blocks, attn.scaling)
            else:
                out, _ = sdpa_attention_forward(
                    attn, q, keys, values, mask, dropout=0.0, scaling=attn.scaling, sliding_window=None
                )
            x = x + _run_products(layer.o, out.reshape(1, n, -1).contiguous())[0]
            gate, up = _run_products(layer.gate_up, layer.post_norm(x))
            x = x + _run_products(layer.down, layer.act(gate) * up)[0]
        return decoder.norm(x)


@dataclass(frozen=True)
class _Layer:
    """One decoder layer as the lean loop runs it: its attention module (for the attention call's settings), its
    norms' forwards, and its products (`packed_linear.products`)."""

    attn: torch.nn.Module
    input_norm: Callable[[torch.Tensor], torch.Tensor]
    post_norm: Callable[[torch.Tensor], torch.Tensor]
    q_norm: Callable[[torch.Tensor], torch.Tensor] | None
    k_norm: Callable[[torch.Tensor], torch.Tensor] | None
    act: Callable[[torch.Tensor], torch.Tensor]
    qkv: list[Product]
    o: list[Product]
    gate_up: list[Product]
    down: list[Product]

    @classmethod
    def of(cls, layer: torch.nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm = getattr(attn, "q_norm", None)
        return cls(
            attn=attn,
            input_norm=layer.input_layernorm.forward,
            post_norm=layer.post_attention_layernorm.forward,
            q_norm=None if q_norm is None else q_norm.forward,
            k_norm=None if q_norm is None else attn.k_norm.forward,
            act=mlp.act_fn,
            qkv=products([attn.q_proj, attn.k_proj, attn.v_proj]),
            o=products([attn.o_proj]),
            gate_up=products([mlp.gate_proj, mlp.up_proj]),
            down=products([mlp.down_proj]),
        )


def _seen_rows(mask: torch.Tensor, start: int) -> list[list[int]]:
    """Per row of a draft tree's additive mask (`tree_mask`: every row sees the ``start`` cached positions), the new
    rows it sees."""
    allowed = mask[0, 0] == 0
    if not bool(allowed[:, :start].all()):
        raise ValueError("a lean forward's tree mask must let every row see the whole cache")
    return [row.nonzero().squeeze(-1).tolist() for row in allowed[:, start:]]


def _run_products(group: list[Product], x: torch.Tensor) -> list[torch.Tensor]:
    """Every projection of ``group`` applied to ``x`` (decode-matched where a matched forward runs)."""
    outputs: list[torch.Tensor] = []
    for key, kernel, splits in group:
        y = decode_matched.matched_product(key, kernel, x)
        outputs.extend(y.split(splits, dim=-1) if len(splits) > 1 else (y,))
    return outputs
