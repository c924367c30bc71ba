"""A lean forward for the Llama, Qwen2, Qwen3 and Gemma 3 families: the model's own modules, none of its plumbing.

transformers' forward of a decoder wraps every step in machinery a decode step does not need: output-capturing
decorators, keyword routing, a mask built per call, a cache object's generic update path, per-layer wrappers.
On a model as small as SmolLM2-135M that Python is a large share of each step. `LeanTarget` runs the same
computation from the loaded model's own modules and weights (no copy beyond the packed weights `packed_linear`
keeps): embedding, rotary tables from the model's rotary module, each layer's norms, projections (packed, fused,
decode-matched), q/k norms, ``apply_rotary_pos_emb``, the cache write (a position-indexed buffer:
`kv_cache.GrowableLayer`, rollback = set the length), attention, the MLP, the final norm and the LM head.

Attention: where the native ops run, the prefill (of prompts up to `NATIVE_PREFILL_MAX` tokens) and every
decode-matched forward (the default: every forward after the prefill, the 1-token step included) run each layer's
row-wise work (norms, q/k norms, rotary embedding, cache write, attention, the gated activation, residuals) in the
native ops (`native_ops`: four calls per layer instead of some fifty PyTorch ops, each row computed by the same
instruction sequence at any width, attention over exactly the keys each row may see), around the same packed
products; other forwards without decode matching make transformers' own ``sdpa`` call. Where the native ops are off
or cannot be built (or for a model they do not cover) the prefill makes that call too, so its logits are the model
forward's bit for bit, and matched forwards run the PyTorch path, attention by `block_attention`: fixed-shape
float32 blocks in which each row is computed the same way at any width. Either way a k-token verification's rows
equal the 1-token steps bitwise (`check_exactness` confirms it at load), and the logits agree with the model
forward's to float32 rounding of the attention (plain greedy decoding in float32 equals transformers' on the real
model and the toys). Cache, rollback, draft trees and hidden states for MTP are `TransformersTarget`'s.

The cache holds keys and values in the model's dtype, or in float16 (`options.KV_CACHES`: by default for a GGUF file
run as stored, whose products take float32 activations), rounded once as written and widened exactly as read.

Because the native layer loop computes every row the same way at any width and start, a prefill may keep the
cached rows of its prompt's longest prefix (from the live cache or a kept earlier sequence's) and compute only the
rest, bit for bit what a fresh prefill gives (`prefix_reuse`; where the loop does not run, nothing is reused).

Gemma 3 (where the native ops run): its layers' extra norms of the attention and MLP outputs, norms of ``1 + w``,
GELU, local and global rotary tables, and sliding-window layers, whose rows see only the last ``window`` keys (every
layer's cache is kept whole, so rollback stays a length), run as per-layer native calls from Python (the one-call
layer loop covers the Llama shape); draft chains only (no trees), batches one sequence at a time.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lattice_inference.errors import ConfigError
from lattice_inference.options import PREFIX_BUDGET, check_kv_cache
from lattice_inference.targets import decode_matched, native_ops
from lattice_inference.targets.base import Segment, SegmentOutput, Target, TargetSequence
from lattice_inference.targets.block_attention import Block, block_attention, plan_blocks
from lattice_inference.targets.decode_matched import Product, RowPlan
from lattice_inference.targets.kv_cache import GrowableLayer
from lattice_inference.targets.packed_linear import packed_operands, products, quant_packed
from lattice_inference.targets.prefix_reuse import CachedRows, KeptSequences, RowKey
from lattice_inference.targets.transformers import TransformersTarget, tree_depths, tree_mask

LEAN_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "gemma3_text"})
"""``model_type`` values whose decoder `LeanTarget` runs (rotary positions, RMSNorm; full attention, and Gemma 3's
sliding-window layers where the native ops run)."""
WINDOWED_TYPES = frozenset({"gemma3_text"})
"""Model types whose sliding-window layers the lean forward runs (on the native ops: each row's visible keys cut to
the window, every layer's cache kept whole)."""


def lean_supported(model: PreTrainedModel) -> str | None:
    """None where `LeanTarget` can run ``model``, else why not (one phrase)."""
    config = model.config
    if config.model_type not in LEAN_MODEL_TYPES:
        return f"model type {config.model_type!r} is not one of {sorted(LEAN_MODEL_TYPES)}"
    if getattr(config, "_attn_implementation", None) not in ("sdpa", decode_matched.ATTENTION):
        return f"attention implementation {config._attn_implementation!r} is not sdpa"
    windowed = any(t != "full_attention" for t in getattr(config, "layer_types", None) or ())
    if windowed and config.model_type not in WINDOWED_TYPES:
        return "it has sliding-window layers"
    if windowed and native_ops.ops() is None:
        return f"its sliding-window layers run on the native ops only ({native_ops.unavailable() or 'off'})"
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
        return "it caps its logits"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    decoder = getattr(model, "model", None)
    if not all(hasattr(decoder, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "its decoder does not have the Llama layout"
    return None


NATIVE_PREFILL_MAX = 4096
"""Longest prompt the native ops prefill (else the PyTorch path's flash attention). Prompts a native prefill computes
can reuse cached rows later (`prefix_reuse`); flash attention's cannot. With runs of at most 32 rows dealt from both
ends of the prompt (`lean_ops.cpp`, ``RUN_ROWS``) the native prefill is no dearer than flash attention up to here:
SmolLM2, AMD EPYC Zen 4 (AVX512-BF16), 2 threads, ``bench/bench_prefill.py``, native / flash in ms, bfloat16 199/233
at 256 tokens, 953/1277 at 1024, 2250/2910 at 2048, 7037/8234 at 4096; float32 692/856 at 512, 4009/4231 at 2048,
10122/10684 at 4096 (before, one run of all rows per head: 3821/2944 at 2048 in bfloat16)."""


KEEP_TAIL = 16
"""Fewest cached rows past a reused prefix worth keeping: a prompt that leaves at least this many of a cached
sequence's rows unused gets a copy of the prefix (the sequence stays whole for a later prompt); one that leaves fewer
(a conversation's next turn, whose re-encoded answer departs from the generated tokens near its end) continues the
cache in place."""


class LeanSequence(TargetSequence):
    """A sequence of a `LeanTarget`: also the ids of its cached rows and the key they were computed under
    (`CachedRows`), which a later prefill may reuse."""

    def __init__(self, target: Target, owner: str | None = "", *, capture_hidden: bool = False) -> None:
        super().__init__(target, owner, capture_hidden=capture_hidden)
        self.rows = CachedRows()


class LeanTarget(TransformersTarget):
    """`TransformersTarget` whose forwards run the lean decoder loop (see the module docstring); only for models
    `lean_supported` accepts."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        packed_weights: bool = True,
        decode_matched: bool = True,
        native: bool = True,
        prefix_cache: bool = True,
        prefix_budget: int = PREFIX_BUDGET,
        kv_cache: str = "auto",
    ) -> None:
        check_kv_cache(kv_cache)
        reason = lean_supported(model)
        if reason is not None:
            raise ConfigError(f"the lean forward cannot run this model: {reason}")
        super().__init__(model, packed_weights=packed_weights, decode_matched=decode_matched)
        self._rotary = sys.modules[type(model).__module__].apply_rotary_pos_emb
        self._layers = [_Layer.of(layer) for layer in model.model.layers]
        text = model.config
        self._head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self._groups = text.num_attention_heads // text.num_key_value_heads
        self._heads, self._kv_heads = text.num_attention_heads, text.num_key_value_heads
        self._native = native_ops.ops() if native and self._native_fits(model) else None
        self._windowed = any(layer.window is not None for layer in self._layers)
        self._rope_kinds = _rope_kinds(self._layers)
        """The layers' rotary kinds (`_Layer.rope`): one table each per forward."""
        if self._windowed and self._native is None:
            raise ConfigError("the lean forward runs sliding-window layers on the native ops only, which are off here")
        self._loop = (
            _LayerLoop.of(self._layers, self.facts.row_plans, self._heads, self._kv_heads)
            if self._native is not None
            else None
        )
        self.verifies_trees = True
        """Every layer's cache is a `GrowableLayer` (whose rows `keep_rows` moves; sliding windows cut what a row
        sees, not the cache), and both forwards take a tree's rows: the native one by key spans in position order
        (a window is a span's last keys), the PyTorch one by mask (`_window_mask` cuts a tree's window by depth)."""
        self.kv_dtype = self._kv_dtype(kv_cache, model)
        """The dtype the cache stores keys and values in (`options.KV_CACHES`): the model's, or float16 under
        float32 activations where the native ops run."""
        self.prefix_cache = prefix_cache
        """Whether a `prefill` may keep the cached rows of the prompt's longest prefix already in the cache, where
        they are bit for bit what it would compute (`prefix_reuse`): from the live cache or from the caches of the
        earlier sequences it keeps, least recently used dropped first past ``prefix_budget`` tokens."""
        self._kept: KeptSequences[DynamicCache | None] = KeptSequences(prefix_budget if prefix_cache else 0)
        self._live: weakref.WeakSet[LeanSequence] = weakref.WeakSet()
        """The sequences handed out and not released (`forget_prefix` makes theirs unreusable too)."""

    def new_sequence(self, owner: str | None = "", *, capture_hidden: bool = False) -> LeanSequence:
        seq = LeanSequence(self, owner, capture_hidden=capture_hidden)
        self._live.add(seq)
        return seq

    def _lean(self, seq: TargetSequence) -> LeanSequence:
        """``seq`` as this target's (refusing another target's or a released one)."""
        self._own(seq)
        assert isinstance(seq, LeanSequence)
        return seq

    @property
    def kv_cache(self) -> str:
        return "float16" if self.kv_dtype != self.model.dtype else ""

    def _kv_dtype(self, kv_cache: str, model: PreTrainedModel) -> torch.dtype:
        """The cache's dtype for ``kv_cache`` (`options.KV_CACHES`): ``auto`` is float16 where the layer loop runs
        GGUF-quantized products (float32 activations), as llama.cpp caches such files; ``float16`` is refused where
        the native ops do not run or the activations are not float32."""
        fits = self._native is not None and model.dtype == torch.float32
        if kv_cache == "float16":
            if not fits:
                why = "the native ops do not run here" if self._native is None else f"this model runs in {model.dtype}"
                raise ConfigError(f"kv_cache float16 needs float32 activations and the native ops; {why}")
            return torch.float16
        if kv_cache == "auto" and fits and self.quantized:
            return torch.float16
        return model.dtype

    def _logits(
        self,
        seq: TargetSequence,
        ids: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor | None,
        logits_to_keep: int,
        prefill: bool,
    ) -> torch.Tensor:
        n, start = ids.shape[1], seq.length
        cache = self.cache_of(seq)
        mask = attention_mask
        blocks = None
        prefill = prefill and mask is None and start + n <= NATIVE_PREFILL_MAX
        if self._native is not None and (decode_matched.active() or prefill):
            hidden = self._native_decoder(cache, start, ids, positions, _visible_keys(start, n, mask, self.device))
            return self.model.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        if decode_matched.active():
            blocks = plan_blocks(start, n, None if mask is None else _seen_rows(mask, start), self._groups, self.device)
        elif mask is None and 1 < n and start > 0:
            # rows at once over a cache: the causal mask transformers' sdpa_mask builds for this case
            mask = torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril(start)[None, None]
        hidden = self._decoder(cache, start, ids, positions, mask, blocks)
        return self.model.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)

    def prefill(self, seq: TargetSequence, token_ids: Sequence[int]) -> torch.Tensor:
        """`TransformersTarget.prefill`, keeping the cached rows of the prompt's longest prefix held by ``seq``'s
        cache or a kept one of its owner where they are what this prefill would compute (`prefix_reuse`;
        ``seq.reused`` says how many)."""
        self._check_prefill(seq, token_ids)
        seq = self._lean(seq)
        key = None if seq.capture_hidden else self._row_key(seq.owner, len(token_ids))
        keep = 0
        if key is not None:
            keep = seq.rows.reusable(token_ids, key)
            index, kept = self._kept.best(token_ids, key)
            if kept > keep:
                keep = kept
                rows, cache = self._kept.take(index)
                self._kept.keep(seq.rows, self._cache_or_none(seq))
                seq.rows, seq.cache, seq.length = rows, cache, len(rows.tokens)
        seq.reused = keep
        if not keep:
            logits = super().prefill(seq, token_ids)  # a new cache: the old one is kept (`_new_cache`)
            seq.rows.key = key
            return logits
        if seq.length - keep >= KEEP_TAIL and self._kept.budget:
            self._copy_prefix(seq, keep)  # the rows after the prefix stay findable for a later prompt
        self.rollback(seq, keep)
        return self._run(seq, token_ids[keep:], logits_to_keep=1, prefill=True)[-1]

    @staticmethod
    def _cache_or_none(seq: TargetSequence) -> DynamicCache | None:
        assert seq.cache is None or isinstance(seq.cache, DynamicCache)
        return seq.cache

    def _copy_prefix(self, seq: LeanSequence, rows: int) -> None:
        """Continue ``seq`` in a new cache holding a copy of its cache's first ``rows`` rows; the old one is kept
        whole (`_new_cache`)."""
        source, cached = self.cache_of(seq), seq.rows
        self._new_cache(seq)
        for mine, theirs in zip(self.cache_of(seq).layers, source.layers, strict=True):
            mine.update(theirs.keys[..., :rows, :], theirs.values[..., :rows, :])
        seq.length = rows
        seq.rows.key = cached.key
        seq.rows.fed(cached.tokens[:rows])

    def _retire(self, seq: TargetSequence) -> None:
        seq = self._lean(seq)
        self._live.discard(seq)
        self._kept.keep(seq.rows, self._cache_or_none(seq))

    @property
    def batches_sequences(self) -> bool:  # type: ignore[override]
        """Whether `forward_batch` runs several sequences in one forward: where the native layer loop runs this
        target's matched forwards (every product row plan 1, so a row comes out the same whatever other rows share
        the product; rotary embedding, cache writes and attention run per sequence)."""
        probe = torch.empty(0, dtype=self.model.dtype)
        return self.decode_matched and self._loop is not None and self._loop.runs(probe)

    def forward_batch(self, segments: Sequence[Segment]) -> list[SegmentOutput]:
        """Every segment's rows in one pass of the native layer loop (`decode_layers` over several sequences):
        products over all rows at once, each sequence's rotary embedding, cache writes and attention over its own
        cache, as its own forward makes them; so each segment's logits equal those of its sequence's `forward`
        (or `forward_tree`) alone, bit for bit (the self-check compares them at load)."""
        if not self.batches_sequences:
            return super().forward_batch(segments)
        assert self._native is not None and self._loop is not None
        ids: list[int] = []
        positions: list[int] = []
        visible, starts, rows, buffers = [], [], [], []
        like = torch.empty(1, self._kv_heads, 0, self._head_dim, dtype=self.kv_dtype, device=self.device)
        fed: list[tuple[LeanSequence, int]] = []
        try:
            for segment in segments:
                seq, tokens = self._lean(segment.sequence), list(segment.tokens)
                self._check_forward(seq, tokens)
                start, n = seq.length, len(tokens)
                mask = None
                if segment.parents is None:
                    positions.extend(range(start, start + n))
                else:
                    if len(segment.parents) != n:
                        raise ValueError(f"a draft tree of {n} tokens needs {n} parents, got {len(segment.parents)}")
                    positions.extend(start + d for d in tree_depths(segment.parents))
                    mask = tree_mask(segment.parents, start, self.model.dtype, self.device)
                visible.append(_visible_keys(start, n, mask, self.device))
                buffers.append([cache.append_in_place(n, like) for cache in self.cache_of(seq).layers])
                fed.append((seq, start))
                seq.length += n
                seq.rows.fed(tokens)
                ids += tokens
                starts.append(start)
                rows.append(n)
            logits, hidden = self._batched_layers(ids, positions, buffers, visible, starts, rows)
        except BaseException:
            for seq, start in fed:  # leave every sequence as it was
                self.rollback(seq, start)
            raise
        outputs, first = [], 0
        for (seq, _), n in zip(fed, rows, strict=True):
            seq.hidden = hidden[first : first + n] if seq.capture_hidden else None
            outputs.append(SegmentOutput(logits[first : first + n], seq.hidden))
            first += n
        return outputs

    def _batched_layers(
        self,
        ids: list[int],
        positions: list[int],
        buffers: list[list[tuple[torch.Tensor, torch.Tensor]]],
        visible: list[tuple[torch.Tensor, torch.Tensor]],
        starts: list[int],
        rows: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and hidden states of the rows of several sequences through the native layer loop
        (`_LayerLoop.run`), each sequence's keys and values written to its own ``buffers`` (per layer)."""
        ops, loop, decoder = self._native, self._loop, self.model.model
        assert ops is not None and loop is not None
        with torch.inference_mode(), decode_matched.matching(self.facts.row_plans):
            x = decoder.embed_tokens(torch.tensor([ids], dtype=torch.long, device=self.device))[0]
            tables = self._rope_tables(x, torch.tensor([positions], dtype=torch.long, device=self.device))
            x = loop.run(ops, x, tables, buffers, visible, starts, rows)
            hidden = decoder.norm(x[None])
            logits = self.model.lm_head(hidden)[0]
        return logits, hidden[0]

    def _rope_tables(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """Per rotary kind of the layers (Gemma 3: local and global), the cos and sin tables ``[n, dim]`` of
        ``positions`` ``[1, n]``, contiguous (as the native ops take them)."""
        rotary, tables = self.model.model.rotary_emb, {}
        for kind in self._rope_kinds:
            cos, sin = rotary(x, positions) if kind is None else rotary(x, positions, kind)
            tables[kind] = (cos[0].contiguous(), sin[0].contiguous())
        return tables

    def forget_prefix(self, owner: str | None = None) -> None:
        self._kept.forget(owner)
        for seq in list(self._live):
            if owner is None or seq.rows.owned_by(owner):
                seq.rows.key = None

    def _row_key(self, owner: str | None, prompt_length: int) -> RowKey | None:
        """The `RowKey` under which a fresh prefill of ``prompt_length`` tokens computes its rows as every later
        forward does (the native layer loop: a prompt of at most `NATIVE_PREFILL_MAX` tokens, decode-matched
        forwards after it, row plans of 1), or None where its rows would not be reusable."""
        if not (self.prefix_cache and self.decode_matched and self._loop is not None) or owner is None:
            return None
        probe = torch.empty(0, dtype=self.model.dtype)
        if prompt_length > NATIVE_PREFILL_MAX or not self._loop.runs(probe):
            return None
        return (probe.dtype, self.kv_dtype, torch.get_num_threads(), owner)

    def _new_cache(self, seq: TargetSequence) -> None:
        seq = self._lean(seq)
        self._kept.keep(seq.rows, self._cache_or_none(seq))
        super()._new_cache(seq)
        if self._windowed:  # every layer's cache kept whole: a window cuts what a row sees
            cache = self.cache_of(seq)
            cache.layers = [GrowableLayer() for _ in cache.layers]
        seq.rows = CachedRows()

    def _fed(self, seq: TargetSequence, token_ids: Sequence[int]) -> None:
        self._lean(seq).rows.fed(token_ids)

    def rollback(self, seq: TargetSequence, length: int) -> None:
        super().rollback(seq, length)
        self._lean(seq).rows.rollback(length)

    def keep_rows(self, seq: TargetSequence, start: int, rows: Sequence[int]) -> None:
        super().keep_rows(seq, start, rows)  # a prefix of the rows: a rollback, which has trimmed the rows already
        self._lean(seq).rows.keep(start, rows)

    @property
    def quantized(self) -> bool:
        """Whether any layer's product runs over GGUF-quantized blocks (`packed_linear.quant_packed`)."""
        groups = (group for layer in self._layers for group in (layer.qkv, layer.o, layer.gate_up, layer.down))
        operands = (packed_operands(group[0]) for group in groups)
        return any(found is not None and quant_packed(found[0]) for found in operands)

    @property
    def native(self) -> bool:
        """Whether matched forwards run the native row-wise ops (`native_ops`) rather than the PyTorch path."""
        return self._native is not None

    def _native_fits(self, model: PreTrainedModel) -> bool:
        """Whether the native ops compute this model's layers: SiLU MLPs, the standard RMSNorm, float32 or
        bfloat16 weights, a head dimension that is a multiple of 8."""
        layer = model.model.layers[0]
        return (
            _activation(model.config) in ACTIVATIONS
            and type(layer.input_layernorm).__name__.endswith("RMSNorm")
            and model.dtype in (torch.float32, torch.bfloat16)
            and self._head_dim % 8 == 0
            and self.device.type == "cpu"
        )

    def _native_decoder(
        self,
        cache: DynamicCache,
        start: int,
        ids: torch.Tensor,
        positions: torch.Tensor,
        visible: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """`_decoder` for matched forwards through the native ops: per layer a fused norm, the products, one call
        for q/k norms, rotary embedding and the cache write, one for attention (each row over exactly the keys
        ``visible`` gives it), one for the gated activation."""
        ops, decoder = self._native, self.model.model
        assert ops is not None
        n = ids.shape[1]
        x = decoder.embed_tokens(ids)[0]
        ropes = self._rope_tables(x, positions)
        keys, offsets = visible
        like = x.new_empty(1, self._kv_heads, 0, self._head_dim, dtype=self.kv_dtype)
        if self._loop is not None and self._loop.runs(x):  # a batch of one, as `forward_batch` runs several
            buffers = [layer.append_in_place(n, like) for layer in cache.layers]
            x = self._loop.run(ops, x, ropes, [buffers], [visible], [start], [n])
            return decoder.norm(x[None])
        windowed = {w: _windowed_spans(offsets, w) for w in {layer.window for layer in self._layers} if w is not None}
        h = ops.rms_norm(x, *self._layers[0].input_weight)
        last = len(self._layers) - 1
        for index, (layer, kv) in enumerate(zip(self._layers, cache.layers, strict=True)):
            k_buf, v_buf = kv.append_in_place(n, like)
            q = ops.rope_qk_cache(
                _product(layer.qkv, h), layer.q_weight, layer.k_weight, layer.qk_eps, *ropes[layer.rope],
                k_buf, v_buf, start, self._heads, self._kv_heads,
            )  # fmt: skip
            spans = offsets if layer.window is None else windowed[layer.window]
            out = _product(layer.o, ops.attention(q, k_buf, v_buf, keys, spans, layer.attn.scaling))
            if layer.attn_out_weight is not None:
                out = ops.rms_norm(out, *layer.attn_out_weight)
            h = ops.add_rms_norm(x, out, *layer.post_weight)
            gate_up = _product(layer.gate_up, h)
            down = _product(layer.down, ops.gelu_tanh_mul(gate_up) if layer.gelu else ops.silu_mul(gate_up))
            if layer.mlp_out_weight is not None:
                down = ops.rms_norm(down, *layer.mlp_out_weight)
            if index == last:
                x = x + down
            else:
                h = ops.add_rms_norm(x, down, *self._layers[index + 1].input_weight)
        return decoder.norm(x[None])

    def _decoder(
        self,
        cache: DynamicCache,
        start: int,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        blocks: list[Block] | None,
    ) -> torch.Tensor:
        """The decoder's hidden states after its final norm, ``[1, n, hidden]``, writing each layer's keys and
        values at the cache's current length (rounded to `kv_dtype`); attention by ``blocks`` (`block_attention`)
        where given, else transformers' ``sdpa`` call under ``mask``, over the cached keys and values widened back."""
        decoder = self.model.model
        x = decoder.embed_tokens(ids)
        ropes = {}
        for kind in self._rope_kinds:
            ropes[kind] = decoder.rotary_emb(x, positions) if kind is None else decoder.rotary_emb(x, positions, kind)
        n, head_dim = ids.shape[1], self._head_dim
        span = 0 if blocks is None else max(block.reach for block in blocks)
        for layer, kv in zip(self._layers, cache.layers, strict=True):
            attn = layer.attn
            h = layer.input_norm(x)
            q, k, v = _run_products(layer.qkv, h)
            q, k, v = q.view(1, n, -1, head_dim), k.view(1, n, -1, head_dim), v.view(1, n, -1, head_dim)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = self._rotary(q.transpose(1, 2), k.transpose(1, 2), *ropes[layer.rope])
            keys, values = kv.update(k.to(self.kv_dtype), v.transpose(1, 2).to(self.kv_dtype))
            if blocks is not None:
                out = block_attention(q, *(b.to(q.dtype) for b in kv.buffers(span)), blocks, attn.scaling)
            else:
                keys, values = keys.to(q.dtype), values.to(q.dtype)
                seen = mask if layer.window is None else _window_mask(mask, start, positions[0], layer.window)
                out, _ = sdpa_attention_forward(
                    attn, q, keys, values, seen, dropout=0.0, scaling=attn.scaling, sliding_window=None
                )
            out = _run_products(layer.o, out.reshape(1, n, -1).contiguous())[0]
            x = x + (out if layer.attn_out_norm is None else layer.attn_out_norm(out))
            gate, up = _run_products(layer.gate_up, layer.post_norm(x))
            down = _run_products(layer.down, layer.act(gate) * up)[0]
            x = x + (down if layer.mlp_out_norm is None else layer.mlp_out_norm(down))
        return decoder.norm(x)


def _window_mask(mask: torch.Tensor | None, start: int, positions: torch.Tensor, window: int) -> torch.Tensor:
    """The boolean mask ``[1, 1, n, start + n]`` of the new rows at ``positions`` (``[n]``) over a sliding window of
    ``window`` keys (each row sees itself and the keys of the ``window - 1`` positions before it, as transformers'
    sliding masks do), within ``mask``: None (a chain's causal rows), a boolean mask, or a draft tree's additive one
    (`tree_mask`: row ``i`` sees the cache and its ancestors). A key's position is its column in the cache, and for a
    new row's column the position of that row, so a tree's window is cut by depth as plain decoding cuts it."""
    rows = positions[:, None]
    cols = torch.cat([torch.arange(start, device=positions.device), positions])[None, :]
    seen = (cols <= rows) & (cols > rows - window)  # a chain's rows: causal too, one position each
    if mask is not None:
        seen = seen & (mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0)
    return seen[None, None]


def _rope_kinds(layers: list[_Layer]) -> list[str | None]:
    """The distinct rotary kinds of ``layers`` (`_Layer.rope`), in a fixed order: the native loop's table order."""
    return sorted({layer.rope for layer in layers}, key=str)


def _windowed_spans(spans: torch.Tensor, window: int) -> torch.Tensor:
    """A chain's key spans (`_visible_keys`: row ``i`` sees key rows ``begin..end``, the keys being the cache
    positions in order) cut to the last ``window`` keys of each row."""
    cut = spans.clone()
    cut[:, 0] = torch.clamp(spans[:, 1] - window, min=0).maximum(spans[:, 0])
    return cut


ACTIVATIONS = {"silu": False, "gelu_pytorch_tanh": True}
"""Gated MLP activations the native ops compute: name -> whether it is GELU (its tanh form) rather than SiLU."""


def _activation(config: object) -> str | None:
    """The MLP's activation (``hidden_act``, Gemma's ``hidden_activation``)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)


@dataclass(frozen=True)
class _Layer:
    """One decoder layer as the lean loop runs it: its attention module (for the attention call's settings), its
    norms' forwards, and its products (`packed_linear.products`); Gemma 3's norms of the attention and MLP outputs,
    its sliding window and its layer's rotary kind where it has them."""

    attn: torch.nn.Module
    input_norm: Callable[[torch.Tensor], torch.Tensor]
    post_norm: Callable[[torch.Tensor], torch.Tensor]
    """The norm before the MLP (Llama's ``post_attention_layernorm``, Gemma's ``pre_feedforward_layernorm``)."""
    q_norm: Callable[[torch.Tensor], torch.Tensor] | None
    k_norm: Callable[[torch.Tensor], torch.Tensor] | None
    act: Callable[[torch.Tensor], torch.Tensor]
    qkv: list[Product]
    o: list[Product]
    gate_up: list[Product]
    down: list[Product]
    input_weight: tuple[torch.Tensor, float]
    """The input norm's weight and epsilon (for the native ops), as is each ``*_weight`` below (Gemma's norms
    multiply by ``1 + weight``: that sum is given)."""
    post_weight: tuple[torch.Tensor, float]
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    qk_eps: float
    attn_out_norm: Callable[[torch.Tensor], torch.Tensor] | None = None
    mlp_out_norm: Callable[[torch.Tensor], torch.Tensor] | None = None
    attn_out_weight: tuple[torch.Tensor, float] | None = None
    mlp_out_weight: tuple[torch.Tensor, float] | None = None
    window: int | None = None
    """Keys a row sees (itself and those before it) in a sliding-window layer, else None."""
    rope: str | None = None
    """The rotary tables' kind (``rotary_emb``'s ``layer_type``) where the model has several, else None."""
    gelu: bool = False

    @classmethod
    def of(cls, layer: torch.nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm = getattr(attn, "q_norm", None)
        gemma = hasattr(layer, "pre_feedforward_layernorm")
        pre_mlp = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
        window = getattr(attn, "sliding_window", None)
        return cls(
            attn=attn,
            input_norm=layer.input_layernorm.forward,
            post_norm=pre_mlp.forward,
            q_norm=None if q_norm is None else q_norm.forward,
            k_norm=None if q_norm is None else attn.k_norm.forward,
            act=mlp.act_fn,
            qkv=products([attn.q_proj, attn.k_proj, attn.v_proj]),
            o=products([attn.o_proj]),
            gate_up=products([mlp.gate_proj, mlp.up_proj]),
            down=products([mlp.down_proj]),
            input_weight=_norm_weight(layer.input_layernorm),
            post_weight=_norm_weight(pre_mlp),
            q_weight=None if q_norm is None else _norm_weight(q_norm)[0],
            k_weight=None if q_norm is None else _norm_weight(attn.k_norm)[0],
            qk_eps=1e-6 if q_norm is None else _norm_weight(q_norm)[1],
            attn_out_norm=layer.post_attention_layernorm.forward if gemma else None,
            mlp_out_norm=layer.post_feedforward_layernorm.forward if gemma else None,
            attn_out_weight=_norm_weight(layer.post_attention_layernorm) if gemma else None,
            mlp_out_weight=_norm_weight(layer.post_feedforward_layernorm) if gemma else None,
            window=int(window) if window else None,
            rope=getattr(attn, "layer_type", None) if gemma else None,
            gelu=ACTIVATIONS.get(str(_activation(attn.config)), False),
        )


@dataclass(frozen=True)
class _LayerLoop:
    """What the native layer loop (``decode_layers``) takes besides the rows: every layer's packed weights and
    biases (q/k/v, o, gate/up, down), norm weights and epsilons, Gemma 3's output norms, windows and rotary kinds,
    the attention's shape; and the products whose row plans must be 1 for it to run. `run` makes the one call."""

    parts: list[torch.Tensor]
    """Each product's weight, layer by layer (q/k/v, o, gate/up, down): one packed matrix each, or (with
    ``part_counts``) that many parts one after another."""
    biases: list[torch.Tensor | None]
    norms: list[torch.Tensor]
    """Each layer's input norm and pre-MLP norm weights."""
    eps: float
    qk_norms: list[torch.Tensor | None]
    """Each layer's q and k norm weights (None: none)."""
    qk_eps: float
    out_norms: list[torch.Tensor | None]
    """Gemma 3's norms of the attention and MLP outputs, two per layer (empty: none)."""
    windows: list[int]
    """Each layer's sliding window (0: none)."""
    rope_of: list[int]
    """Each layer's rotary table: an index into `rope_kinds`."""
    gelu: bool
    part_counts: list[int]
    """Each product's count of weight parts (empty: one each)."""
    heads: int
    kv_heads: int
    scaling: float
    rope_kinds: list[str | None]
    """The rotary tables' kinds (``rotary_emb``'s ``layer_type``; None: the model's one table), in table order."""
    products: list[Product]
    """One per distinct product (plan key): whose row plans decide whether the loop runs."""
    plans: dict[tuple[object, ...], RowPlan]
    """The target's row plans (``target.facts.row_plans``), which the verdicts read."""
    _verdicts: dict[tuple[torch.dtype, int], bool] = field(default_factory=dict)

    @classmethod
    def of(
        cls, layers: list[_Layer], plans: dict[tuple[object, ...], RowPlan], heads: int, kv_heads: int
    ) -> _LayerLoop | None:
        """The loop's operands, or None where a layer's products are not single packed matrices, its norms'
        epsilons differ or its layers mix activations (the Python loop runs those)."""
        packed, biases, norms, qk_norms, out_norms = [], [], [], [], []
        products: dict[tuple[object, ...], Product] = {}
        for layer in layers:
            for group in (layer.qkv, layer.o, layer.gate_up, layer.down):
                operands = packed_operands(group[0]) if len(group) == 1 else None
                if operands is None:
                    return None
                packed.append(operands[0])
                biases.append(operands[1])
                products.setdefault(group[0][0], group[0])
            norms += [layer.input_weight[0], layer.post_weight[0]]
            qk_norms += [layer.q_weight, layer.k_weight]
            out_norms += [None if w is None else w[0] for w in (layer.attn_out_weight, layer.mlp_out_weight)]
        outs = [w[1] for layer in layers for w in (layer.attn_out_weight, layer.mlp_out_weight) if w is not None]
        eps = {e for layer in layers for e in (layer.input_weight[1], layer.post_weight[1])} | set(outs)
        if len(eps) != 1 or len({layer.qk_eps for layer in layers}) != 1 or len({la.gelu for la in layers}) != 1:
            return None
        kinds = _rope_kinds(layers)
        counts = [len(parts) for parts in packed]
        return cls(
            parts=[part for parts in packed for part in parts],
            biases=biases,
            norms=norms,
            eps=eps.pop(),
            qk_norms=qk_norms,
            qk_eps=layers[0].qk_eps,
            out_norms=out_norms if any(w is not None for w in out_norms) else [],
            windows=[layer.window or 0 for layer in layers],
            rope_of=[kinds.index(layer.rope) for layer in layers],
            gelu=layers[0].gelu,
            part_counts=counts if any(n > 1 for n in counts) else [],
            heads=heads,
            kv_heads=kv_heads,
            scaling=float(layers[0].attn.scaling),
            rope_kinds=kinds,
            products=list(products.values()),
            plans=plans,
        )

    def run(
        self,
        ops: ModuleType,
        x: torch.Tensor,
        tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]],
        buffers: list[list[tuple[torch.Tensor, torch.Tensor]]],
        visible: list[tuple[torch.Tensor, torch.Tensor]],
        starts: list[int],
        rows: list[int],
    ) -> torch.Tensor:
        """Every layer over the rows ``x`` ``[n, hidden]`` of one or more sequences (``rows[s]`` consecutive rows of
        sequence ``s``, written from ``starts[s]`` to its own per-layer key/value ``buffers[s]``, each row seeing
        the keys ``visible[s]`` gives it), with the rotary ``tables`` by kind: the residual stream after the last
        layer (``x``, updated in place)."""
        layers = len(self.windows)
        return ops.decode_layers(
            x, self.parts, self.biases, self.norms, self.eps, self.qk_norms, self.qk_eps,
            [seq[layer][0] for layer in range(layers) for seq in buffers],
            [seq[layer][1] for layer in range(layers) for seq in buffers],
            [tables[kind][0] for kind in self.rope_kinds], [tables[kind][1] for kind in self.rope_kinds],
            [keys for keys, _ in visible], [spans for _, spans in visible], starts, rows,
            self.heads, self.kv_heads, self.scaling, self.out_norms, self.windows, self.rope_of, self.gelu,
            self.part_counts,
        )  # fmt: skip

    def runs(self, x: torch.Tensor) -> bool:
        """Whether every product computes its rows at any width as alone (row plan 1) at ``x``'s dtype and the
        current thread count, as the loop computes them (decided once per dtype and thread count)."""
        when = (x.dtype, torch.get_num_threads())
        verdict = self._verdicts.get(when)
        if verdict is None:
            verdict = self._verdicts[when] = all(
                decode_matched.plan_for(key, kernel, x.new_zeros(1, _in_features(key)), self.plans).base == 1
                for key, kernel, _ in self.products
            )
        return verdict


def _in_features(key: tuple[object, ...]) -> int:
    shape = key[1]
    assert isinstance(shape, tuple)
    return int(shape[1])


def _norm_weight(norm: torch.nn.Module) -> tuple[torch.Tensor, float]:
    """An RMSNorm's weight and epsilon (transformers names it ``variance_epsilon`` or ``eps``); for Gemma's norms,
    which multiply by ``1 + weight`` in float32, that sum."""
    eps = getattr(norm, "variance_epsilon", None)
    weight = norm.weight.detach()
    if type(norm).__name__.startswith("Gemma"):
        weight = (1.0 + weight.float()).to(weight.dtype)
    return weight, float(getattr(norm, "eps", 1e-6) if eps is None else eps)


def _visible_keys(
    start: int, rows: int, mask: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache rows each new row attends to: key rows and each row's ``(begin, end)`` span of them. A chain's
    rows share one list (row ``i`` sees the cache and the chain up to itself: a prefix of it); a draft tree's
    ``mask`` gives each row the cache and its ancestors, one list per row."""
    if mask is None:
        ends = torch.arange(start + 1, start + rows + 1)
        spans = torch.stack([torch.zeros_like(ends), ends], dim=1)
        return torch.arange(start + rows, device=device), spans.to(device)
    cache = list(range(start))
    flat: list[int] = []
    spans_list: list[list[int]] = []
    for row in _seen_rows(mask, start):
        spans_list.append([len(flat), len(flat) + start + len(row)])
        flat.extend((*cache, *(start + r for r in row)))
    return torch.tensor(flat, dtype=torch.long, device=device), torch.tensor(spans_list, device=device)


def _product(group: list[Product], x: torch.Tensor) -> torch.Tensor:
    """The whole output of ``group``'s projections of ``x`` (one fused product, or the members' side by side)."""
    outputs = [decode_matched.matched_product(key, kernel, x) for key, kernel, _ in group]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


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
