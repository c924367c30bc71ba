"""A lean forward for the Llama, Qwen2, Qwen3 and Gemma 3 families: the model's own modules, none of its plumbing.

transformers' forward of a decoder wraps every step in machinery a decode step does not need: output-capturing
decorators, keyword routing, a mask built per call, a cache object's generic update path, per-layer wrappers.
On a model as small as SmolLM2-135M that Python is a large share of each step. `LeanTarget` runs the same
computation from the loaded model's own modules and weights (no copy beyond the packed weights `packed_linear`
keeps): embedding, rotary tables from the model's rotary module, each layer's norms, projections (packed, fused,
decode-matched), q/k norms, ``apply_rotary_pos_emb``, the cache write (a position-indexed buffer:
`kv_cache.GrowableLayer`, rollback = set the length), attention, the MLP, the final norm and the LM head.

The layers run through one of two runners built at construction (`lean_forward`): `NativeForward` where the native
ops run, for the prefill (of prompts of any length) and every decode-matched forward (the
default: every forward after the prefill, the 1-token step included): each layer's row-wise work (norms, q/k norms,
rotary embedding, cache write, attention, the gated activation, residuals) in the native ops (`native_ops`: one call
for all layers where every product's row plan is 1, else four per layer; each row computed by the same instruction
sequence at any width, attention over exactly the keys each row may see), around the same packed products; and
`TorchForward` for the rest: unmatched forwards make transformers' own ``sdpa`` call, and where
the native ops are off or cannot be built (or for a model they do not cover) matched forwards take attention from
`block_attention`: fixed-shape float32 blocks in which each row is computed the same way at any width. Either way a
k-token verification's rows equal the 1-token steps bitwise (`check_exactness` confirms it at load), and the logits
agree with the model forward's to float32 rounding of the attention (plain greedy decoding in float32 equals
transformers' on the real model and the toys). Cache, rollback, draft trees and hidden states for MTP are
`TransformersTarget`'s; each sequence's cache and the ids of its cached rows are its `LeanSequence`'s.

The cache holds keys and values in the model's dtype, or in float16 (`options.KV_CACHES`: by default for a GGUF file
run as stored, whose products take float32 activations), rounded once as written and widened exactly as read.

Because the native layer loop computes every row the same way at any width and start, a prefill may keep the
cached rows of its prompt's longest prefix (from the live cache or a kept earlier sequence's) and compute only the
rest, bit for bit what a fresh prefill gives (`prefix_reuse`; where the loop does not run, nothing is reused).

Gemma 3 (where the native ops run): its layers' extra norms of the attention and MLP outputs, norms of ``1 + w``,
GELU, local and global rotary tables, and sliding-window layers, whose rows see only the last ``window`` keys (every
layer's cache is kept whole, so rollback stays a length; a tree's window is cut by position), run in the same native
calls.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from lattice_inference.errors import ConfigError, TokenError
from lattice_inference.kernels import decode_matched, native_ops
from lattice_inference.kernels.packed_linear import packed_operands, quant_packed
from lattice_inference.options import (
    PREFIX_BUDGET,
    PREFIX_BUDGET_FALLBACK,
    PROMPT_CACHE_SIZE,
    check_kv_cache,
    check_kv_slots,
)
from lattice_inference.targets import memory, prompt_store
from lattice_inference.targets.base import Segment, SegmentOutput, Target, TargetSequence
from lattice_inference.targets.kv_cache import CacheSlots, GrowableLayer
from lattice_inference.targets.lean_forward import (
    ACTIVATIONS,
    Layer,
    LayerLoop,
    NativeForward,
    TorchForward,
    activation,
    head_dim_of,
    visible_keys,
)
from lattice_inference.targets.prefix_reuse import CachedRows, KeptSequences, RowKey
from lattice_inference.targets.prompt_store import PromptStore
from lattice_inference.targets.transformers import FedRows, TransformersTarget, tree_depths, tree_mask

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


KEEP_TAIL = 16
"""Fewest cached rows past a reused prefix worth keeping: a prompt that leaves at least this many of a cached
sequence's rows unused gets a copy of the prefix (the sequence stays whole for a later prompt); one that leaves fewer
(a conversation's next turn, whose re-encoded answer departs from the generated tokens near its end) continues the
cache in place."""


class LeanSequence(TargetSequence):
    """A sequence of a `LeanTarget`: also the ids of its cached rows and the key they were computed under
    (`CachedRows`), which a later prefill may reuse."""

    def __init__(
        self, target: Target, owner: str | None = "", *, capture_hidden: bool = False, probe: bool = False
    ) -> None:
        super().__init__(target, owner, capture_hidden=capture_hidden, probe=probe)
        self.rows = CachedRows()


class LeanTarget(TransformersTarget):
    """`TransformersTarget` whose forwards run the lean decoder loop (see the module docstring); only for models
    `lean_supported` accepts."""

    provides_hidden_states = True
    """Its own forward computes the post-final-norm rows it hands ``lm_head`` (no probe needed)."""
    checks_causality = False  # Llama, Qwen2/3 and Gemma 3 decoders only (`lean_supported`)

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        packed_weights: bool = True,
        decode_matched: bool = True,
        native: bool = True,
        prefix_cache: bool = True,
        prefix_budget: int | None = PREFIX_BUDGET,
        kv_cache: str = "auto",
        kv_slots: int = 0,
        slot_rows: int | None = None,
        prompt_cache: str | None = None,
        prompt_cache_size: int = PROMPT_CACHE_SIZE,
    ) -> None:
        check_kv_cache(kv_cache)
        check_kv_slots(kv_slots)
        reason = lean_supported(model)
        if reason is not None:
            raise ConfigError(f"the lean forward cannot run this model: {reason}")
        super().__init__(model, packed_weights=packed_weights, decode_matched=decode_matched)
        model = self.model  # this target's view, prepared by the base class
        self._layers = [Layer.of(layer) for layer in model.model.layers]
        text = model.config
        self._head_dim = head_dim_of(text)
        self._heads, self._kv_heads = text.num_attention_heads, text.num_key_value_heads
        self._native = native_ops.ops() if native and self._native_fits(model) else None
        self._windowed = any(layer.window is not None for layer in self._layers)
        if self._windowed and self._native is None:
            raise ConfigError("the lean forward runs sliding-window layers on the native ops only, which are off here")
        self._loop = (
            LayerLoop.of(self._layers, self.facts.row_plans, self._heads, self._kv_heads)
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
        self._torch = TorchForward(model, self._layers, self.kv_dtype)
        """The PyTorch path: unmatched forwards, and every forward where the native ops do not run."""
        self._native_forward = None
        if self._native is not None:
            self._native_forward = NativeForward(self._native, model, self._layers, self._loop, self.kv_dtype)
        """The native ops' path (where they run): matched forwards and every prompt, at any length (so a prompt's
        rows are what every later forward computes, and reusable: `prefix_reuse`). Its attention is blocked over the
        keys (online softmax, `lean_ops.cpp` ``attend``), so a long cache costs what a short one does per key."""
        self._step_forward = self._native_forward if decode_matched else None
        """What runs every forward after a prefill, chosen here: the native ops where they run and the forwards are
        decode-matched; else (None) the PyTorch path, decode-matched or not as the target is."""
        self.prefix_cache = prefix_cache
        """Whether a `prefill` may keep the cached rows of the prompt's longest prefix already in the cache, where
        they are bit for bit what it would compute (`prefix_reuse`): from the live cache or from the caches of the
        earlier sequences it keeps, least recently used dropped first past ``prefix_budget`` tokens (None: sized from
        the available memory, `memory.auto_budget`) or while the machine runs low (`memory.low_memory`)."""
        token_bytes = len(self._layers) * 2 * self._kv_heads * self._head_dim * self.kv_dtype.itemsize
        self.prefix_memory = (
            memory.auto_budget(token_bytes, self.device, PREFIX_BUDGET_FALLBACK)
            if prefix_budget is None
            else memory.PrefixMemory(prefix_budget, token_bytes, 0)
        )
        """The prefix cache's token budget and what it was sized from (`memory.PrefixMemory.line`)."""
        device = self.device
        self._kept: KeptSequences[DynamicCache | None] = KeptSequences(
            self.prefix_memory.tokens if prefix_cache else 0, low_memory=lambda: memory.low_memory(device)
        )
        self.prompt_store = self._prompt_store(prompt_cache, prompt_cache_size * 2**20) if prompt_cache else None
        """The prompt cache on disk (``prompt_cache``: its folder; `prompt_store`), whose files a prefill takes rows
        from as from a kept sequence, and to which each ended sequence's rows are saved; None: none."""
        self._live: weakref.WeakSet[LeanSequence] = weakref.WeakSet()
        """The sequences handed out and not released (`forget_prefix` makes theirs unreusable too)."""
        self.kv_slots = kv_slots
        self._slots = self._cache_slots(kv_slots, slot_rows)
        """Where ``kv_slots`` is set: that many preallocated caches (`kv_cache.CacheSlots`) of ``slot_rows`` positions
        each (default the model's positions), one per sequence held (live or kept for prefix reuse; the least
        recently kept is dropped to free one); else None: each sequence's cache grows as it needs."""

    def new_sequence(
        self, owner: str | None = "", *, capture_hidden: bool = False, probe: bool = False
    ) -> LeanSequence:
        seq = LeanSequence(self, owner, capture_hidden=capture_hidden, probe=probe)
        self._live.add(seq)
        return seq

    def _cache_slots(self, count: int, rows: int | None) -> CacheSlots | None:
        """The `CacheSlots` for ``kv_slots=count`` (None for 0): ``rows`` positions each, else the model's."""
        if not count:
            return None
        rows = rows or self.max_positions
        if not rows or rows < 1:
            raise ConfigError("kv_slots needs slot_rows where the model does not say how many positions it has")
        layers = len(self._layers)
        return CacheSlots(count, rows, layers, self._kv_heads, self._head_dim, self.kv_dtype, self.device)

    @property
    def slots(self) -> CacheSlots | None:
        """This target's preallocated cache slots (``kv_slots``), else None."""
        return self._slots

    def _check_room(self, seq: TargetSequence, rows: int) -> None:
        """A `TokenError` where ``seq`` would need ``rows`` positions past its cache slot (before any change)."""
        if self._slots is not None and not seq.probe and rows > self._slots.rows:
            raise TokenError(f"{rows} positions do not fit a cache slot of {self._slots.rows} (kv_slots)")

    def _check_prefill(self, seq: TargetSequence, token_ids: Sequence[int]) -> None:
        super()._check_prefill(seq, token_ids)
        self._check_room(seq, len(token_ids))

    def _check_forward(self, seq: TargetSequence, token_ids: Sequence[int]) -> None:
        super()._check_forward(seq, token_ids)
        self._check_room(seq, seq.length + len(token_ids))

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

    def _logits(self, seq: TargetSequence, fed: FedRows, logits_to_keep: int, prefill: bool) -> torch.Tensor:
        start, cache = seq.length, self.cache_of(seq)
        if prefill:  # a prompt's rows: the native ops where they run, at any length
            native = self._native_forward if fed.mask is None else None
        else:
            native = self._step_forward
        if native is not None:
            hidden = native.hidden(cache, start, fed)
        else:
            hidden = self._torch.hidden(cache, start, fed, matched=not prefill and self.decode_matched)
        return self.model.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)

    def prefill(self, seq: TargetSequence, token_ids: Sequence[int]) -> torch.Tensor:
        """`TransformersTarget.prefill`, keeping the cached rows of the prompt's longest prefix held by ``seq``'s
        cache or a kept one of its owner where they are what this prefill would compute (`prefix_reuse`;
        ``seq.reused`` says how many)."""
        self._check_prefill(seq, token_ids)
        seq = self._lean(seq)
        key = None if seq.capture_hidden else self._row_key(seq.owner)
        keep = self._reuse(seq, token_ids, key)
        if not keep:
            logits = super().prefill(seq, token_ids)  # a new cache: the old one is kept (`_new_cache`)
            seq.rows.key = key
            return logits
        return self._run(seq, token_ids[keep:], logits_to_keep=1, prefill=True)[-1]

    def open_prompt(self, sequence: TargetSequence, token_ids: Sequence[int]) -> int | None:
        """`Target.open_prompt`: where forwards batch (the native layer loop computes every row the same way at any
        width, a prefill's rows included), the longest reusable prefix is kept as `prefill` keeps it (none where
        nothing is reusable: another owner's, or the prefix cache off), and the rest is left to forwards."""
        self._check_prefill(sequence, token_ids)
        seq = self._lean(sequence)
        if seq.capture_hidden or not self.batches_sequences:
            return None
        key = self._row_key(seq.owner)
        keep = self._reuse(seq, token_ids, key)
        if not keep:
            self._new_cache(seq)
            seq.rows.key = key
        return keep

    def _reuse(self, seq: LeanSequence, token_ids: Sequence[int], key: RowKey | None) -> int:
        """Set ``seq`` up to keep the most cached rows of ``token_ids`` computed under ``key`` (its own, or a kept
        sequence's, which becomes its cache), rolled back to them; returns how many (``seq.reused``; 0: none, and
        ``seq`` is as it was)."""
        keep = 0
        if key is not None:
            keep = seq.rows.reusable(token_ids, key)
            index, kept = self._kept.best(token_ids, key)
            if kept > keep:
                keep = kept
                rows, cache = self._kept.take(index)
                self._kept.keep(seq.rows, self._cache_or_none(seq))
                seq.rows, seq.cache, seq.length = rows, cache, len(rows.tokens)
            keep = max(keep, self._from_store(seq, token_ids, key, keep))
        seq.reused = keep
        if keep:
            if seq.length - keep >= KEEP_TAIL and self._kept.budget:
                self._copy_prefix(seq, keep)  # the rows after the prefix stay findable for a later prompt
            self.rollback(seq, keep)
        return keep

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
        store, key = self.prompt_store, seq.rows.key
        if store is not None and seq.cache is not None and key is not None and key == self._stored_key():
            layers = [(layer.keys, layer.values) for layer in self.cache_of(seq).layers]
            store.save(seq.rows.tokens[: seq.length], layers)
        self._kept.keep(seq.rows, self._cache_or_none(seq))

    def _prompt_store(self, folder: str, size: int) -> PromptStore:
        """The `PromptStore` of ``folder`` for this target: its identity is everything a row's value depends on
        beyond its tokens (the weights, dtypes, thread count, kernels' build, versions)."""
        kernels = native_ops.build_directory().name if self._native is not None else "none"
        identity = {
            "format": prompt_store.FORMAT,
            "lattice": prompt_store.lattice_version(),
            "torch": torch.__version__,
            "kernels": kernels,
            "model": prompt_store.model_fingerprint(self.model, self._packed_weights()),
            "dtype": str(self.model.dtype),
            "kv_cache": str(self.kv_dtype),
            "threads": str(torch.get_num_threads()),
            "reusable": str(self._row_key("") is not None),
        }
        return PromptStore(folder, identity, size)

    def _stored_key(self) -> RowKey | None:
        """The `RowKey` of the rows the prompt cache on disk holds: the default owner's (a process's own user; a
        server's tenants never share files) under the thread count it was opened with."""
        store = self.prompt_store
        key = None if store is None else self._row_key("")
        if key is None or store is None or str(key[2]) != store.identity["threads"]:
            return None
        return key

    def _from_store(self, seq: LeanSequence, token_ids: Sequence[int], key: RowKey, have: int) -> int:
        """Make ``seq``'s cache the prompt-cache file's rows where a file holds more of ``token_ids`` than the
        ``have`` rows found in memory (its current cache is kept as a kept sequence); returns the rows taken."""
        store = self.prompt_store
        if store is None or key != self._stored_key():
            return 0
        path, rows = store.best(token_ids)
        if path is None or rows <= have:
            return 0
        layers = store.load(path, rows, self.device)
        self._new_cache(seq)  # the old cache is kept (`_new_cache`); this one starts empty
        for layer, (k, v) in zip(self.cache_of(seq).layers, layers, strict=True):
            layer.update(k.to(self.kv_dtype), v.to(self.kv_dtype))
        seq.rows.key = key
        seq.rows.fed(token_ids[:rows])
        seq.length = rows
        return rows

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
        native = self._native_forward
        assert native is not None
        ids: list[int] = []
        positions: list[int] = []
        visible, starts, rows, buffers = [], [], [], []
        like = native.empty_rows(torch.empty(0, device=self.device))
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
                visible.append(visible_keys(start, n, mask, self.device))
                buffers.append([cache.append_in_place(n, like) for cache in self.cache_of(seq).layers])
                fed.append((seq, start))
                seq.length += n
                seq.rows.fed(tokens)
                ids += tokens
                starts.append(start)
                rows.append(n)
            wanted = [min(s.logits, n) or n for s, n in zip(segments, rows, strict=True)]
            with torch.inference_mode(), decode_matched.matching(self.facts.row_plans):
                rows_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
                hidden = native.batch(rows_ids, positions, buffers, visible, starts, rows)
                if sum(wanted) == len(ids):
                    logits = self.model.lm_head(hidden)
                else:  # the vocabulary product of the wanted rows only (a prompt chunk's last, or none)
                    ends = torch.tensor(rows).cumsum(0).tolist()
                    index = [r for end, w in zip(ends, wanted, strict=True) for r in range(end - w, end)]
                    logits = self.model.lm_head(hidden[torch.tensor(index, device=self.device)])
        except BaseException:
            for seq, start in fed:  # leave every sequence as it was
                self.rollback(seq, start)
            raise
        outputs, first, at = [], 0, 0
        for (seq, _), n, w in zip(fed, rows, wanted, strict=True):
            seq.hidden = hidden[first : first + n] if seq.capture_hidden else None
            outputs.append(SegmentOutput(logits[at : at + w], seq.hidden))
            first, at = first + n, at + w
        return outputs

    def forget_prefix(self, owner: str | None = None) -> None:
        self._kept.forget(owner)
        for seq in list(self._live):
            if owner is None or seq.rows.owned_by(owner):
                seq.rows.key = None

    def _row_key(self, owner: str | None) -> RowKey | None:
        """The `RowKey` under which a fresh prefill computes its rows as every later
        forward does (the native layer loop: decode-matched forwards after it, row plans of 1), or None where its
        rows would not be reusable."""
        if not (self.prefix_cache and self.decode_matched and self._loop is not None) or owner is None:
            return None
        probe = torch.empty(0, dtype=self.model.dtype)
        if not self._loop.runs(probe):
            return None
        return (probe.dtype, self.kv_dtype, torch.get_num_threads(), owner)

    def _new_cache(self, seq: TargetSequence) -> None:
        seq = self._lean(seq)
        self._kept.keep(seq.rows, self._cache_or_none(seq))
        super()._new_cache(seq)
        seq.rows = CachedRows()
        cache = self.cache_of(seq)
        if self._windowed:  # every layer's cache kept whole: a window cuts what a row sees
            cache.layers = [GrowableLayer() for _ in cache.layers]
        if self._slots is not None and not seq.probe:
            collected = False
            while not self._slots.take(cache):
                if self._kept.drop_oldest():  # the least recently kept sequence frees its slot
                    continue
                if not collected:  # a dropped cache caught in a reference cycle gives its slot back once collected
                    collected = gc.collect() >= 0
                    continue
                seq.cache = None  # as before its first prefill
                raise RuntimeError(f"all {self._slots.count} cache slots (kv_slots) hold live sequences")

    def _fed(self, seq: TargetSequence, token_ids: Sequence[int]) -> None:
        self._lean(seq).rows.fed(token_ids)

    def rollback(self, seq: TargetSequence, length: int) -> None:
        super().rollback(seq, length)
        self._lean(seq).rows.rollback(length)

    def keep_rows(self, seq: TargetSequence, start: int, rows: Sequence[int]) -> None:
        super().keep_rows(seq, start, rows)  # a prefix of the rows: a rollback, which has trimmed the rows already
        self._lean(seq).rows.keep(start, rows)

    def _packed_weights(self) -> list[torch.Tensor]:
        """Every packed weight the layers' products run over (their parts), in layer order."""
        groups = (group for layer in self._layers for group in (layer.qkv, layer.o, layer.gate_up, layer.down))
        found = (packed_operands(product) for group in groups for product in group)
        return [part for operands in found if operands is not None for part in operands[0]]

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
            activation(model.config) in ACTIVATIONS
            and type(layer.input_layernorm).__name__.endswith("RMSNorm")
            and model.dtype in (torch.float32, torch.bfloat16)
            and self._head_dim % 8 == 0
            and self.device.type == "cpu"
        )
