"""Adapters that turn a transformers ``AutoModelForCausalLM`` into a `Target`.

`CausalLMTarget` holds what every transformers target shares: explicit positions, id validation, the model
forward over a ``DynamicCache`` with past recording switched on (so sliding-window and conv layers keep enough
history to be cropped; transformers 5: ``crop`` takes a *negative* count of tokens to drop), and optional
capture of the post-final-norm hidden states that MTP drafting needs.

`TransformersTarget` serves every model whose cache is attention KV only; its rollback is a crop. Models whose
cache holds recurrent state (Gated DeltaNet, Mamba) cannot be rolled back by cropping: it refuses them with
`UnsupportedModelError` instead of producing wrong output (`HybridTarget` serves Qwen3.5 / Qwen3-Next).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

from lattice_inference.devices import first_weight
from lattice_inference.errors import TokenError, UnsupportedModelError
from lattice_inference.kernels import decode_matched as decode_matched_module
from lattice_inference.kernels.packed_linear import pack_linears
from lattice_inference.targets.base import Target, TargetSequence
from lattice_inference.targets.kv_cache import GrowableLayer, record_past, use_growable_layers
from lattice_inference.targets.model_view import runner_view


def recurrent_layer_count(model: PreTrainedModel) -> int:
    """Number of cache layers of ``model`` that hold recurrent (non-croppable) state."""
    try:
        cache = DynamicCache(config=model.config)
    except Exception as exc:  # transformers builds no cache of its own layout for this config
        raise UnsupportedModelError(
            f"model type {model.config.model_type!r} has a cache layout transformers' DynamicCache cannot build from "
            f"its config ({_first_line(exc)})"
        ) from exc
    return sum(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)


def output_rows(output: object) -> torch.Tensor | None:
    """A module's output rows: the tensor it returned, or a model output's ``last_hidden_state`` (else None)."""
    tensor = output if isinstance(output, torch.Tensor) else getattr(output, "last_hidden_state", None)
    return tensor if isinstance(tensor, torch.Tensor) else None


def hidden_state_source(model: PreTrainedModel) -> tuple[torch.nn.Module | None, str]:
    """The module whose output is, row for row, what the output layer (``lm_head``) reads: the hidden states MTP
    heads read (post-final-norm, where the model has one). Found by what the model does, not by attribute names:
    one forward of three tokens with a hook on every module, the first module (in the order they finish) called
    once whose output equals the output layer's input bitwise. Returns ``(module, "")``, or ``(None, why)`` where
    no module gives them (the model then runs every method that does not need hidden states)."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Module):
        return None, f"model type {model.config.model_type!r} has no output embedding layer to read hidden states at"
    inside_head = {id(m) for m in head.modules()}
    finished: list[tuple[torch.nn.Module, torch.Tensor]] = []
    calls: dict[int, int] = {}
    read: list[torch.Tensor] = []

    def record(module: torch.nn.Module, args: object, output: object) -> None:
        calls[id(module)] = calls.get(id(module), 0) + 1
        tensor = output_rows(output)
        if tensor is not None:
            finished.append((module, tensor))

    def reads(module: torch.nn.Module, args: tuple[object, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            read.append(args[0])

    hooks = [m.register_forward_hook(record) for m in model.modules() if id(m) not in inside_head and m is not model]
    hooks.append(head.register_forward_pre_hook(reads))
    vocab = int(cast(torch.Tensor, head.weight).shape[0]) if hasattr(head, "weight") else 3
    ids = torch.tensor([[i % vocab for i in (1, 2, 3)]], device=first_weight(model).device)
    try:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False, logits_to_keep=0)
    except Exception as exc:  # a model that cannot run this probe cannot be read either
        return None, f"probing the hidden states of model type {model.config.model_type!r} failed: {exc}"
    finally:
        for hook in hooks:
            hook.remove()
    if len(read) == 1:
        wanted = read[0]
        for module, tensor in finished:
            if calls[id(module)] == 1 and tensor.shape == wanted.shape and torch.equal(tensor, wanted):
                return module, ""
    return None, (
        f"no module of model type {model.config.model_type!r} outputs the hidden states its output layer reads "
        "(it transforms them on the way)"
    )


REFUSED_FAMILIES: dict[str, str] = {
    "deepseek_v4": "its compressed-attention cache layers keep a running compressor state that cropping the cache "
    "cannot roll back",
}
"""Model types refused by name, with why (what `check_causal_lm`'s probes cannot see)."""


def check_causal_lm(model: PreTrainedModel) -> None:
    """Refuse, with one line naming why, a model that speculative decoding over transformers' forward cannot serve
    losslessly, by what it does rather than by its name: a forward that takes no ``cache`` (its state lives
    outside an attention cache), one that cannot run on token ids alone (it needs pixels or audio), rows that see
    later tokens (an encoder: bidirectional attention), or a cache that cannot take several new rows at once (what
    verifying a draft feeds). Three tiny forwards of four tokens, no cache kept."""
    kind = model.config.model_type
    if kind in REFUSED_FAMILIES:
        raise UnsupportedModelError(f"model type {kind!r} is not supported: {REFUSED_FAMILIES[kind]}")
    if "cache" not in inspect.signature(model.forward).parameters:
        raise UnsupportedModelError(
            f"model type {kind!r} keeps its state outside an attention cache (its forward takes no cache), "
            "so it cannot be rolled back after a rejected draft"
        )
    vocab = int(cast(torch.Tensor, model.get_input_embeddings().weight).shape[0])
    device = first_weight(model).device
    ids = torch.tensor([[1 % vocab, 2 % vocab, 3 % vocab, 4 % vocab]], device=device)
    other = ids.clone()
    other[0, -1] = 5 % vocab
    with torch.inference_mode():
        try:
            full = model(input_ids=ids, use_cache=False).logits.float()
        except Exception as exc:
            raise UnsupportedModelError(
                f"model type {kind!r} fails on token ids alone (as a model needing pixels or audio does): "
                f"{_first_line(exc)}"
            ) from exc
        changed = model(input_ids=other, use_cache=False).logits.float()
        scale = float(full.abs().max()) or 1.0
        if not torch.allclose(full[:, :3], changed[:, :3], rtol=0.0, atol=1e-3 * scale):
            raise UnsupportedModelError(
                f"model type {kind!r} attends to later tokens (an encoder, bidirectional attention), so it is not a "
                "causal LM (if it was trained as a decoder, set is_decoder true in its config.json)"
            )
        try:
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[:, :2], cache=cache, use_cache=True)
            model(input_ids=ids[:, 2:], cache=cache, use_cache=True)
        except Exception as exc:
            raise UnsupportedModelError(
                f"model type {kind!r} cannot score several new tokens over its cache, as verifying a draft does: "
                f"{_first_line(exc)}"
            ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


@dataclass(frozen=True)
class FedRows:
    """The rows one forward feeds after a sequence's cached ones: token ids ``[1, n]`` at ``positions`` ``[1, n]``,
    under ``mask``: None (a chain's causal rows) or a 4D additive mask (a draft tree)."""

    ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor | None


class _Capture:
    """A forward hook on the module `hidden_state_source` found that keeps its output's rows as ``seq.hidden``
    (registered for the one forward of a sequence that captures hidden states)."""

    def __init__(self, seq: TargetSequence) -> None:
        self.seq = seq

    def __call__(self, module: torch.nn.Module, args: object, output: object) -> None:
        tensor = output_rows(output)
        if tensor is not None:
            self.seq.hidden = tensor[0]


class CausalLMTarget(Target):
    """Shared machinery of the transformers targets; subclasses define rollback.

    A sequence made with ``capture_hidden=True`` keeps, after every `prefill`/`forward`, the post-final-norm hidden
    states of all fed positions in its ``hidden`` (``[n, hidden]``).

    ``packed_weights`` (default on) runs the model's linear layers over packed weights where this CPU supports
    their dtype (`pack_linears`: faster decode steps and much cheaper verification; it routes the ``nn.Linear``
    forwards of this target's view of the model, never the caller's, and keeps a packed copy of their weights, one
    per weight however many targets share the model).

    ``decode_matched`` (default on) computes every row of a `forward` of several tokens bit for bit as a 1-token
    `forward` computes it (`lattice_inference.kernels.decode_matched`: row-planned linear layers, per-row
    attention), so verification scores drafted tokens exactly as plain decoding would, in every dtype. Off, a
    forward runs the model's kernels over all its rows at once (faster where those kernels round differently).
    """

    def __init__(self, model: PreTrainedModel, *, packed_weights: bool = True, decode_matched: bool = True) -> None:
        self.model = model = runner_view(model).eval()
        """This target's view of the model it was given (`model_view.runner_view`: the same weights, its own modules
        and config), which it prepares below; the caller's model is left as it was."""
        if packed_weights:
            pack_linears(model)
        self.decode_matched = decode_matched
        if decode_matched:
            decode_matched_module.match_dense_linears(model)
            decode_matched_module.match_row_wise_modules(model)
            decode_matched_module.match_attention(model)
        self.device = first_weight(model).device
        self._vocab_size = int(cast(torch.Tensor, model.get_input_embeddings().weight).shape[0])
        max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self._max_positions = int(max_pos) if max_pos else None
        self._hidden_source: tuple[torch.nn.Module | None, str] | None = None  # found on first use

    def _hidden_states_at(self) -> tuple[torch.nn.Module | None, str]:
        """`hidden_state_source` of this target's model, probed once, when a method first needs hidden states."""
        if self._hidden_source is None:
            self._hidden_source = hidden_state_source(self.model)
        return self._hidden_source

    @property
    def provides_hidden_states(self) -> bool:  # type: ignore[override]
        """Whether sequences can capture hidden states: where some module outputs what the output layer reads
        (`hidden_state_source`; probed on first use, so a model without one still runs every other method)."""
        return self._hidden_states_at()[0] is not None

    @property
    def hidden_states_problem(self) -> str:
        """Why this target gives no hidden states ("" where it does)."""
        return self._hidden_states_at()[1]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_positions(self) -> int | None:
        return self._max_positions

    @staticmethod
    def cache_of(seq: TargetSequence) -> DynamicCache:
        """``seq``'s transformers cache (after its `prefill`)."""
        cache = seq.cache
        if cache is None:
            raise RuntimeError("forward() called before prefill()")
        assert isinstance(cache, DynamicCache)
        return cache

    def _check_ids(self, token_ids: Sequence[int]) -> None:
        for t in token_ids:
            if not 0 <= t < self._vocab_size:
                raise TokenError(f"token id {t} is outside the vocabulary of size {self._vocab_size}")

    def _check_prefill(self, seq: TargetSequence, token_ids: Sequence[int]) -> None:
        self._own(seq)
        if not token_ids:
            raise TokenError("cannot prefill an empty prompt: at least one token is needed")
        self._check_ids(token_ids)

    def _check_forward(self, seq: TargetSequence, token_ids: Sequence[int]) -> None:
        self._own(seq)
        if seq.cache is None:
            raise RuntimeError("forward() called before prefill()")
        if not token_ids:
            raise TokenError("forward() needs at least one token")
        self._check_ids(token_ids)

    def _new_cache(self, seq: TargetSequence) -> None:
        """Give ``seq`` an empty cache that records past states so that it can be cropped."""
        seq.cache = record_past(use_growable_layers(DynamicCache(config=self.model.config)))
        seq.length = 0

    def _run(
        self,
        seq: TargetSequence,
        token_ids: Sequence[int],
        logits_to_keep: int,
        *,
        offsets: Sequence[int] | None = None,
        attention_mask: torch.Tensor | None = None,
        matched: bool = False,
        prefill: bool = False,
    ) -> torch.Tensor:
        """One model forward over ``token_ids`` written at ``seq``'s cache rows ``length..``, at positions
        ``length + i`` (or ``length + offsets[i]``, with a 4D ``attention_mask``: a draft tree); returns logits
        ``[kept, vocab]`` and, where ``seq`` captures them, keeps the rows' hidden states in ``seq.hidden``.
        ``matched``: decode-matched rows, where this target computes them (forwards after a prefill); ``prefill``:
        rows of a prompt (a prefill, or the part of it after a reused prefix)."""
        n, start = len(token_ids), seq.length
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        if offsets is None:
            positions = torch.arange(start, start + n, device=self.device).unsqueeze(0)
        else:
            positions = torch.tensor([[start + o for o in offsets]], dtype=torch.long, device=self.device)
        fed = FedRows(ids, positions, attention_mask)
        matching = (
            decode_matched_module.matching(self.facts.row_plans)
            if matched and self.decode_matched
            else contextlib.nullcontext()
        )
        seq.hidden = None
        source = self._hidden_states_at()[0] if seq.capture_hidden else None
        hook = source.register_forward_hook(_Capture(seq)) if source is not None else None
        try:
            with torch.inference_mode(), matching:
                logits = self._logits(seq, fed, logits_to_keep, prefill or start == 0)
        finally:
            if hook is not None:
                hook.remove()
        seq.length += n
        self._fed(seq, token_ids)
        return logits[0]

    def _fed(self, seq: TargetSequence, token_ids: Sequence[int]) -> None:
        """Rows for ``token_ids`` were just written after ``seq``'s earlier ones (for subclasses that track the ids
        of their cache rows)."""

    def _logits(self, seq: TargetSequence, fed: FedRows, logits_to_keep: int, prefill: bool) -> torch.Tensor:
        """The model's logits ``[1, kept, vocab]`` for the ``fed`` rows over ``seq``'s cache (the forward itself,
        which subclasses may run their own way; ``prefill``: rows of a prompt)."""
        out = self.model(
            input_ids=fed.ids,
            position_ids=fed.positions,
            attention_mask=fed.mask,
            cache=seq.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        return out.logits


TREE_ATTENTION = ("sdpa", "eager", decode_matched_module.ATTENTION)
"""Attention implementations that apply a custom 4D additive mask as given (what `forward_tree` passes)."""


def tree_mask(parents: Sequence[int], cached: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive mask ``[1, 1, n, cached + n]`` of a draft tree: every row sees the ``cached`` positions, itself
    and its ancestors (``parents[i]``, -1 for the root), and nothing else (``finfo.min`` elsewhere)."""
    n = len(parents)
    allowed = torch.zeros(n, cached + n, dtype=torch.bool)
    allowed[:, :cached] = True
    for i, parent in enumerate(parents):
        if parent >= 0:
            allowed[i] = allowed[parent]
        allowed[i, cached + i] = True
    mask = torch.zeros(n, cached + n, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.to(device)[None, None]


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Each row's distance from the root of a tree given by ``parents`` (checked: one root, row 0, and every other
    row's parent an earlier row)."""
    if not parents or parents[0] != -1:
        raise ValueError(f"a draft tree's row 0 is its only root (parent -1), got parents {list(parents)}")
    depths = [0]
    for i, parent in enumerate(parents[1:], start=1):
        if not 0 <= parent < i:
            raise ValueError(f"row {i} of a draft tree must follow an earlier row, got parent {parent}")
        depths.append(depths[parent] + 1)
    return depths


class TransformersTarget(CausalLMTarget):
    """A `Target` over a transformers causal LM whose cache is attention KV only; rollback crops the cache.

    Where every cache layer is full attention (no sliding window) and attention applies custom masks (sdpa,
    eager), it also verifies draft trees: a tree is one forward under a tree mask, and keeping a path moves that
    path's keys and values into place (`GrowableLayer.keep`).

    At construction it refuses, with one line, a model it cannot serve losslessly (`check_causal_lm`)."""

    checks_causality = True
    """Whether construction runs `check_causal_lm` (subclasses that run only known decoder families skip it)."""

    def __init__(self, model: PreTrainedModel, *, packed_weights: bool = True, decode_matched: bool = True) -> None:
        recurrent = recurrent_layer_count(model)
        if recurrent:
            raise UnsupportedModelError(
                f"model type {model.config.model_type!r} has {recurrent} recurrent-state cache layer(s) "
                "(linear attention / state space); their state cannot be rolled back by cropping the cache, "
                "so speculative decoding would not be lossless on it with this target "
                "(Qwen3.5 / Qwen3-Next: use HybridTarget or make_target)"
            )
        if self.checks_causality:
            check_causal_lm(model)
        super().__init__(model, packed_weights=packed_weights, decode_matched=decode_matched)
        # A draft verified inside the prefill forward would be scored as prompt rows are, not as decode steps.
        self.fuses_prefill_and_draft = not decode_matched
        layers = DynamicCache(config=self.model.config).layers
        attention = getattr(self.model.config, "_attn_implementation", None)
        self.verifies_trees = attention in TREE_ATTENTION and all(type(layer) is DynamicLayer for layer in layers)

    def prefill(self, seq: TargetSequence, token_ids: Sequence[int]) -> torch.Tensor:
        self._check_prefill(seq, token_ids)
        self._new_cache(seq)
        logits = self._run(seq, token_ids, logits_to_keep=1, prefill=True)[-1]
        self.cache_of(seq).crop(0)  # bound sliding-window layers back to their window
        return logits

    def prefill_with_draft(self, seq: TargetSequence, token_ids: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        """Prefill ``token_ids`` and verify ``draft`` in the same forward: logits ``[len(draft) + 1, vocab]`` for
        the last prompt position and every draft position. Roll back to ``len(token_ids) + accepted`` after.

        This saves the separate first verification forward (transformers' prompt lookup does the same); it is
        offered only where rolling back into a prefill is a cheap crop.
        """
        self._check_prefill(seq, token_ids)
        self._check_ids(draft)
        self._new_cache(seq)
        return self._run(seq, [*token_ids, *draft], logits_to_keep=len(draft) + 1, prefill=True)

    def forward(self, seq: TargetSequence, token_ids: Sequence[int]) -> torch.Tensor:
        self._check_forward(seq, token_ids)
        return self._run(seq, token_ids, logits_to_keep=0, matched=True)

    def rollback(self, seq: TargetSequence, length: int) -> None:
        self._own(seq)
        if not 0 <= length <= seq.length:
            raise ValueError(f"cannot roll back to length {length}: the cache holds {seq.length} tokens")
        if seq.cache is None:
            return
        self.cache_of(seq).crop(length - seq.length)
        seq.length = length

    def forward_tree(self, seq: TargetSequence, token_ids: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        if not self.verifies_trees:
            return super().forward_tree(seq, token_ids, parents)
        self._check_forward(seq, token_ids)
        if len(parents) != len(token_ids):
            raise ValueError(
                f"a draft tree of {len(token_ids)} tokens needs {len(token_ids)} parents, got {len(parents)}"
            )
        depths = tree_depths(parents)
        mask = tree_mask(parents, seq.length, self.model.dtype, self.device)
        return self._run(seq, token_ids, logits_to_keep=0, offsets=depths, attention_mask=mask, matched=True)

    def keep_rows(self, seq: TargetSequence, start: int, rows: Sequence[int]) -> None:
        rows = list(rows)
        if rows == list(range(len(rows))) or not self.verifies_trees:
            super().keep_rows(seq, start, rows)
            return
        self._own(seq)
        if rows[0] != 0 or any(b <= a for a, b in itertools.pairwise(rows)) or start + rows[-1] >= seq.length:
            raise ValueError(f"rows to keep must increase from 0 within the {seq.length - start} fed, got {rows}")
        for layer in self.cache_of(seq).layers:
            assert isinstance(layer, GrowableLayer)
            layer.keep(start, rows)
        seq.length = start + len(rows)
