"""Target for hybrid Gated DeltaNet + attention models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) with exact rollback.

Why a separate target: these models keep, next to the attention KV cache, a *recurrent* state per Gated DeltaNet
(GDN) layer (a ``[heads, d_k, d_v]`` matrix updated by the delta rule at every token) plus a short conv state.
transformers' ``Cache.crop(-n)`` after ``activate_past_recording()`` restores the conv state and the attention KV,
but (5.24) leaves the recurrent state as it was after the *last drafted* token, so a speculative decoder built on
it is silently wrong after any rejection; 5.25 restores it only when told to keep states, which makes the last k
tokens run one by one. `TransformersTarget` therefore refuses these models.

How rollback works here:

* ``prefill`` runs the model's normal path (transformers' chunked delta-rule kernel) and keeps nothing extra.
* ``forward`` of ``k <= max_recorded`` tokens routes the GDN calls (`gdn_dispatch.routed_to`) to a `_Recorder`,
  which runs a kernel of `gated_deltanet` that can rebuild the recurrent state after any of its positions:
  ``kernel="window"`` (closed form over the window) or ``kernel="recurrent"`` (token by token, op for op
  transformers' one-token decode arithmetic).
* ``rollback(seq, length)`` has one method per case: nothing to drop (`_commit`); a length inside the last
  forward, with recorded states (`_restore_recorded_state`: writes the state after position ``length - 1`` into
  each GDN layer's cache slot and crops the conv states and attention KV with ``Cache.crop``, exact for those since
  the cache records conv history) or with a snapshot (`_restore_snapshot_and_replay`: a forward longer than
  ``max_recorded`` snapshots the recurrent states first; the rollback restores them and replays the accepted
  tokens); a length before the last forward (`_reprefill`: runs the kept token history again). All are exact.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from lattice_inference.errors import ConfigError, UnsupportedModelError
from lattice_inference.hybrid_families import HYBRID_MODEL_TYPES
from lattice_inference.targets import gdn_dispatch
from lattice_inference.targets.base import Target, TargetSequence
from lattice_inference.targets.gated_deltanet import (
    KeptStates,
    StateSource,
    gated_delta_rule_window,
    recurrent_gated_delta_rule_with_states,
)
from lattice_inference.targets.transformers import CausalLMTarget

SUPPORTED_MODEL_TYPES = HYBRID_MODEL_TYPES
"""transformers ``model_type`` values (top-level or of the text config) that `HybridTarget` accepts."""

DEFAULT_MAX_RECORDED = 16
"""Widest forward that runs a rollback-capable GDN kernel (wider ones use snapshot-and-replay)."""

KERNELS = ("window", "recurrent")
"""GDN kernels `HybridTarget` can run in ``forward``: closed form over the window, or token by token."""


def _model_types(model: PreTrainedModel) -> set[str]:
    """The ``model_type`` of ``model``'s config and of its text config (they differ for multimodal wrappers)."""
    config = model.config
    types = {str(getattr(config, "model_type", ""))}
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        types.add(str(getattr(get_text(), "model_type", "")))
    return types


def _gdn_modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    """Every Gated DeltaNet mixer of ``model`` (modules whose class name ends in ``GatedDeltaNet``)."""
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


def is_hybrid(model: PreTrainedModel) -> bool:
    """Whether ``model`` is a supported hybrid GDN/attention model that `HybridTarget` should serve."""
    return bool(_model_types(model) & SUPPORTED_MODEL_TYPES) and bool(_gdn_modules(model))


class _Recorder:
    """Runs the GDN layers of one model forward with a kernel that can restore the state after any position
    (a `gdn_dispatch.GdnRouter`).

    The GDN kernel does not know its layer; it receives the layer's cached recurrent state as ``initial_state``,
    so layers are identified by the identity of that tensor. ``kernel`` is ``"window"`` (closed form,
    `gated_delta_rule_window`, for windows of 2+ tokens) or ``"recurrent"`` (token by token, op for op
    transformers' decode arithmetic, `recurrent_gated_delta_rule_with_states`, always used for 1 token);
    ``buffers`` (per layer, owned by the target and reused across forwards) receive the recurrent path's states.
    """

    def __init__(
        self, layer_of_state: dict[int, int], buffers: dict[int, torch.Tensor], kernel: str, width: int = 1
    ) -> None:
        self.width = width
        """Tokens fed by this forward (the new columns of each conv input)."""
        self.layer_of_state = layer_of_state
        self.buffers = buffers
        self.kernel = kernel
        self.sources: dict[int, StateSource] = {}

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the recording kernel for one GDN call made as transformers' GDN forward makes it."""
        initial_state = kwargs.get("initial_state")
        if len(args) != 3 or initial_state is None or kwargs.get("cu_seqlens") is not None:
            raise RuntimeError(
                "unexpected Gated DeltaNet kernel call (positional args, missing initial state or packed "
                "sequences); this transformers version is not supported by HybridTarget"
            )
        layer = self.layer_of_state.get(id(initial_state))
        if layer is None:
            raise RuntimeError("a Gated DeltaNet kernel was called with a recurrent state that is not in the cache")
        l2norm = bool(kwargs.get("use_qk_l2norm_in_kernel", False))
        length = args[1].shape[1]
        # The model hands q/k/v as strided views whose layout depends on the token count; reductions over them
        # round by layout, so a dense copy makes each token's arithmetic that of a one-token step.
        query, key, value = (a.contiguous() for a in args)
        g, beta = kwargs["g"].contiguous(), kwargs["beta"].contiguous()
        source: StateSource
        if self.kernel == "window" and length > 1:
            out, final, source = gated_delta_rule_window(query, key, value, g, beta, initial_state, l2norm)
        else:
            buffer = self.buffers.get(layer)
            if buffer is None or buffer.shape[0] < length + 1 or buffer.shape[1:] != initial_state.shape:
                shape = (length + 1, *initial_state.shape)
                buffer = self.buffers[layer] = torch.empty(shape, dtype=torch.float32, device=initial_state.device)
            out, final, states = recurrent_gated_delta_rule_with_states(
                query, key, value, g, beta, initial_state, l2norm, states=buffer
            )
            source = KeptStates(states)
        self.sources[layer] = source
        return out, (final if kwargs.get("output_final_state", False) else None)


@dataclass
class _Window:
    """What the last forward left for rolling back into it: per-layer state sources or a pre-forward snapshot."""

    start: int
    """Cache length before the forward."""
    sources: dict[int, StateSource] | None = None
    """Per GDN cache layer, ``sources[layer].state_at(i)`` = recurrent state after ``start + i`` tokens (valid
    until the next forward, which reuses the buffers)."""
    snapshot: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per GDN cache layer, a copy of the recurrent state before the forward (used when ``sources`` is None)."""


class HybridSequence(TargetSequence):
    """A sequence of a `HybridTarget`: also its token ids (to prefill again where a rollback reaches before the last
    forward), the last forward's rollback window, and whether conv history from it is still kept."""

    def __init__(
        self, target: Target, owner: str | None = "", *, capture_hidden: bool = False, probe: bool = False
    ) -> None:
        super().__init__(target, owner, capture_hidden=capture_hidden, probe=probe)
        self.tokens: list[int] = []
        self.window: _Window | None = None
        self.uncommitted = False
        """True while linear layers keep conv history from the last forward (trimmed by ``crop(0)``)."""


class HybridTarget(CausalLMTarget):
    """A `Target` over a Qwen3-Next / Qwen3.5 / Qwen3.5-MoE causal LM, rolling back attention KV, conv *and*
    recurrent Gated DeltaNet state exactly.

    ``kernel`` picks how forwards of 2..``max_recorded`` tokens run the GDN layers: ``"recurrent"`` (the default
    with ``decode_matched``) is the token-by-token loop, op for op the arithmetic of a one-token step, keeping one
    fp32 ``[v_heads, d_k, d_v]`` state per position and GDN layer (1 MiB at 16 heads of 128) in buffers reused
    across forwards; ``"window"`` (the default without it) is the closed-form chunked delta rule over the window
    (`gated_delta_rule_window`), cheaper on CPU but equal to the recurrence only to float32 rounding. Without
    ``decode_matched``, forwards wider than ``max_recorded`` use transformers' own chunked kernel and
    snapshot-and-replay; with it, every forward after the prefill runs the recurrent loop (its buffers grow to the
    widest forward). See the module docstring and `CausalLMTarget` for ``decode_matched``.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_recorded: int = DEFAULT_MAX_RECORDED,
        kernel: str | None = None,
        packed_weights: bool = True,
        decode_matched: bool = True,
    ) -> None:
        types = _model_types(model)
        if not types & SUPPORTED_MODEL_TYPES:
            given = sorted(t for t in types if t)
            raise UnsupportedModelError(
                f"HybridTarget supports model types {sorted(SUPPORTED_MODEL_TYPES)}, got {given}"
            )
        gdn = _gdn_modules(model)
        if not gdn:
            raise UnsupportedModelError(f"model type {sorted(types)} has no Gated DeltaNet layers")
        modules = {sys.modules[type(m).__module__] for m in gdn}
        for module in modules:
            missing = gdn_dispatch.missing_names(module)
            if missing:
                raise UnsupportedModelError(
                    f"{module.__name__} does not define {missing}; this transformers version is not supported"
                )
        if max_recorded < 1:
            raise ConfigError(f"max_recorded must be at least 1, got {max_recorded}")
        if kernel is None:
            kernel = "recurrent" if decode_matched else "window"
        if kernel not in KERNELS:
            raise ConfigError(f"kernel must be one of {list(KERNELS)}, got {kernel!r}")
        super().__init__(model, packed_weights=packed_weights, decode_matched=decode_matched)
        self.kernel = kernel
        self.max_recorded = max_recorded
        self._modules = sorted(modules, key=lambda m: m.__name__)
        self._buffers: dict[int, torch.Tensor] = {}
        """Per GDN cache layer, storage for the per-position states of a forward (grows to the widest one); the
        window of the last forward of any sequence reads it until that sequence's rollback."""

    # -- Target protocol (vocab_size, max_positions, cache: see CausalLMTarget) ----------------------------------

    def new_sequence(
        self, owner: str | None = "", *, capture_hidden: bool = False, probe: bool = False
    ) -> HybridSequence:
        return HybridSequence(self, owner, capture_hidden=capture_hidden, probe=probe)

    def _hybrid(self, seq: TargetSequence) -> HybridSequence:
        self._own(seq)
        assert isinstance(seq, HybridSequence)
        return seq

    def prefill(self, seq: TargetSequence, token_ids: Sequence[int]) -> torch.Tensor:
        self._check_prefill(seq, token_ids)
        seq = self._hybrid(seq)
        self._reset(seq)
        return self._prefill_history(seq, [int(t) for t in token_ids])

    def forward(self, seq: TargetSequence, token_ids: Sequence[int]) -> torch.Tensor:
        self._check_forward(seq, token_ids)
        seq = self._hybrid(seq)
        self._commit(seq)
        with self._invalidated_on_failure(seq):
            logits = self._forward_keeping_window(seq, token_ids)
        seq.tokens.extend(int(t) for t in token_ids)
        seq.uncommitted = True
        return logits

    def rollback(self, seq: TargetSequence, length: int) -> None:
        seq = self._hybrid(seq)
        if not 0 <= length <= seq.length:
            raise ValueError(f"cannot roll back to length {length}: the cache holds {seq.length} tokens")
        if seq.cache is None:
            return
        window = seq.window
        if length == seq.length:
            self._commit(seq)  # keep every token and forget the last forward's window
        elif window is not None and length >= window.start and window.sources is not None:
            self._restore_recorded_state(seq, window, window.sources, length)
        elif window is not None and length >= window.start:
            self._restore_snapshot_and_replay(seq, window, length)
        else:
            self._reprefill(seq, length)

    # -- the four rollback cases -------------------------------------------------------------------------------

    def _restore_recorded_state(
        self, seq: HybridSequence, window: _Window, sources: dict[int, StateSource], length: int
    ) -> None:
        """Rollback into the last forward, whose kernel recorded every position: write the recurrent state after
        position ``length - 1`` into each GDN layer and crop the conv states and attention KV."""
        with torch.inference_mode():
            for layer, source in sources.items():
                self._recurrent(seq, layer).copy_(source.state_at(length - window.start))
            self._crop(seq, length - seq.length)
        self._set_length(seq, length)

    def _restore_snapshot_and_replay(self, seq: HybridSequence, window: _Window, length: int) -> None:
        """Rollback into the last forward, which was too wide to record: restore the recurrent states it
        snapshotted, crop to its start and run the accepted tokens again."""
        replay = seq.tokens[window.start : length]
        with torch.inference_mode():
            for layer, state in window.snapshot.items():
                self._recurrent(seq, layer).copy_(state)
            self._crop(seq, window.start - seq.length)
        self._set_length(seq, window.start)
        if replay:
            self.forward(seq, replay)
            self._commit(seq)

    def _reprefill(self, seq: HybridSequence, length: int) -> None:
        """Rollback to before the last forward (no state kept there): prefill the first ``length`` tokens again."""
        history = seq.tokens[:length]
        self._reset(seq)
        if history:
            self._prefill_history(seq, history)

    # -- internals -------------------------------------------------------------------------------------------

    def _prefill_history(self, seq: HybridSequence, history: list[int]) -> torch.Tensor:
        """Prefill ``history`` into ``seq``'s empty cache (`_reset`) and commit it: the last position's logits."""
        with self._invalidated_on_failure(seq):
            logits = self._run(seq, history, logits_to_keep=1, prefill=True)[-1]
        seq.tokens = history
        seq.uncommitted = True
        self._commit(seq)
        return logits

    @contextlib.contextmanager
    def _invalidated_on_failure(self, seq: HybridSequence) -> Iterator[None]:
        """Run the block's forward of ``seq``; where it fails, the cache may hold a partial update: `_invalidate`."""
        try:
            yield
        except BaseException:
            self._invalidate(seq)
            raise

    def _forward_keeping_window(self, seq: HybridSequence, token_ids: Sequence[int]) -> torch.Tensor:
        """Run ``token_ids`` and set the window that rollback will use (recorded states or a snapshot)."""
        start = seq.length
        if start == 0:  # nothing cached (after rollback(0)): no state to record from; rollback re-prefills
            return self._run(seq, token_ids, logits_to_keep=0)
        if len(token_ids) > self.max_recorded and not self.decode_matched:
            with torch.inference_mode():
                snapshot = {i: self._recurrent(seq, i).clone() for i in self._linear_layers(seq)}
            logits = self._run(seq, token_ids, logits_to_keep=0)
            seq.window = _Window(start=start, snapshot=snapshot)
            return logits
        recorder = _Recorder(self._layer_of_state(seq), self._buffers, self.kernel, len(token_ids))
        with gdn_dispatch.routed_to(recorder, self._modules):
            logits = self._run(seq, token_ids, logits_to_keep=0, matched=True)
        if set(recorder.sources) != set(self._linear_layers(seq)):
            raise RuntimeError("not every Gated DeltaNet layer ran the recording kernel")
        seq.window = _Window(start=start, sources=recorder.sources)
        return logits

    def _invalidate(self, seq: HybridSequence) -> None:
        """Drop ``seq``'s cache after a failed forward; its next call must be ``prefill``."""
        seq.cache = None
        seq.length = 0
        seq.tokens = []
        seq.window = None
        seq.uncommitted = False

    def _reset(self, seq: HybridSequence) -> None:
        """Give ``seq`` an empty cache that records conv history so that it can be cropped."""
        self._new_cache(seq)
        seq.tokens = []
        seq.window = None
        seq.uncommitted = False

    def _commit(self, seq: HybridSequence) -> None:
        """Forget the rollback window of ``seq``'s last forward and trim the conv history it needed."""
        if seq.cache is not None and seq.uncommitted:
            with torch.inference_mode():
                self._crop(seq, 0)
        seq.uncommitted = False
        seq.window = None

    def _crop(self, seq: HybridSequence, tokens: int) -> None:
        """``Cache.crop(tokens)`` (``tokens <= 0``) of the conv states and attention KV that leaves each GDN layer's
        recurrent state as the rollback has just written it.

        transformers 5.25 crops recurrent states too, from a history it fills only when asked to keep
        intermediate states (and replaces the state tensor, which `_layer_of_state` keys on): we hand it the current
        state as that history, so its crop keeps it. 5.24 has no such history and ignores the field.
        """
        cache = self.cache_of(seq)
        for i in self._linear_layers(seq) if tokens < 0 else []:  # crop(0) only trims conv history
            layer = cache.layers[i]
            assert isinstance(layer, LinearAttentionCacheLayerMixin)
            kept = [layer.recurrent_states[s] for s in range(layer.number_of_states)]
            vars(layer)["recurrent_states_history"] = {s: [state] * -tokens for s, state in enumerate(kept)}
        cache.crop(tokens)

    @staticmethod
    def _set_length(seq: HybridSequence, length: int) -> None:
        seq.length = length
        del seq.tokens[length:]
        seq.window = None
        seq.uncommitted = False

    def _linear_layers(self, seq: HybridSequence) -> list[int]:
        layers = self.cache_of(seq).layers
        return [i for i, layer in enumerate(layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]

    def _recurrent(self, seq: HybridSequence, layer: int) -> torch.Tensor:
        cache_layer = self.cache_of(seq).layers[layer]
        assert isinstance(cache_layer, LinearAttentionCacheLayerMixin)
        state = cache_layer.recurrent_states[0]
        assert state is not None
        return state

    def _layer_of_state(self, seq: HybridSequence) -> dict[int, int]:
        return {id(self._recurrent(seq, i)): i for i in self._linear_layers(seq)}
