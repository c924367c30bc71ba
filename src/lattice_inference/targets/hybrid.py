"""Target for hybrid Gated DeltaNet + attention models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) with exact rollback.

Why a separate target: these models keep, next to the attention KV cache, a *recurrent* state per Gated DeltaNet
(GDN) layer (a ``[heads, d_k, d_v]`` matrix updated by the delta rule at every token) plus a short conv state.
transformers' ``Cache.crop(-n)`` after ``activate_past_recording()`` restores the conv state and the attention KV,
but leaves the recurrent state as it was after the *last drafted* token, so a speculative decoder built on it is
silently wrong after any rejection. `TransformersTarget` therefore refuses these models.

How rollback works here:

* ``prefill`` runs the model's normal path (transformers' chunked delta-rule kernel) and keeps nothing extra.
* ``forward`` of ``k <= max_recorded`` tokens swaps the GDN kernel for one that can rebuild the recurrent state
  after any of its positions. Default (``kernel="window"``): the chunked (UT-transform) delta rule applied to the
  k tokens as one chunk, without transformers' padding to 64; it touches the ``[d_k, d_v]`` state a constant
  number of times and keeps small per-token factors, from which ``state_at(i)`` rebuilds any state in one pass.
  Alternative (``kernel="recurrent"``): the token-by-token recurrence, op for op the arithmetic of transformers'
  ``torch_recurrent_gated_delta_rule`` (which plain one-token decoding uses), keeping every state. Both cost
  less on CPU for k <= 16 than transformers' chunked kernel (which it runs for any k > 1), and both agree with
  k one-token decode steps to float32 rounding. The swap replaces the ``torch_chunk_gated_delta_rule`` /
  ``torch_recurrent_gated_delta_rule`` names in the model's modeling module for the duration of the call
  (reference-counted; a context variable routes only this target's calls, other threads run the originals).
* ``rollback(length)`` inside the last forward writes the state after position ``length - 1`` into each GDN
  layer's cache slot and crops the conv states and attention KV with ``Cache.crop`` (exact for those: the cache
  records conv history, ``activate_past_recording``).
* Fallbacks, both exact: a forward longer than ``max_recorded`` snapshots the recurrent states first and, on a
  rollback into it, restores the snapshot and replays the accepted tokens; a rollback to before the last forward
  re-prefills the kept token history.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from lattice_inference.errors import ConfigError, UnsupportedModelError
from lattice_inference.targets import decode_matched
from lattice_inference.targets.transformers import CausalLMTarget

SUPPORTED_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})
"""transformers ``model_type`` values (top-level or of the text config) that `HybridTarget` accepts."""

DEFAULT_MAX_RECORDED = 16
"""Widest forward that runs a rollback-capable GDN kernel (wider ones use snapshot-and-replay)."""

KERNELS = ("window", "recurrent")
"""GDN kernels `HybridTarget` can run in ``forward``: closed form over the window, or token by token."""

_KERNEL_NAMES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
_CONV_NAME = "causal_conv1d_fn"
"""The GDN layers' short causal convolution, run per new token inside decode-matched forwards."""


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


# --------------------------------------------------------------------------------------------------------------
# The recording kernel and its installation


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """The same L2 normalisation as transformers' GDN ``l2norm`` (FLA-compatible)."""
    inv_norm = torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)
    return x * inv_norm


def _kernel_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    use_qk_l2norm: bool,
) -> list[torch.Tensor]:
    """Kernel inputs as transformers' delta-rule kernels prepare them: grouped k heads repeated to the v heads,
    ``[batch, heads, seq, ...]`` float32, q and k L2-normalised when asked (scaling is left to the caller)."""
    num_k_heads, num_v_heads = key.shape[2], value.shape[-2]
    if num_k_heads != num_v_heads:
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    fmt = torch.contiguous_format
    out = [x.transpose(1, 2).to(torch.float32, memory_format=fmt) for x in (query, key, value, beta, g)]
    if use_qk_l2norm:
        out[0] = _l2norm(out[0], dim=-1, eps=1e-6)
        out[1] = _l2norm(out[1], dim=-1, eps=1e-6)
    return out


def recurrent_gated_delta_rule_with_states(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = False,
    states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token, returning ``(output, final_state, states)``.

    Op for op the computation of transformers' ``torch_recurrent_gated_delta_rule`` (so ``k`` tokens here give the
    same result as ``k`` one-token decode steps, bit for bit given the same inputs), except that every
    intermediate state is written to ``states[i]``, the fp32 recurrent state ``[batch, v_heads, d_k, d_v]`` after
    the first ``i`` tokens (``states[0]`` is a copy of ``initial_state``; ``final_state`` is a view of
    ``states[seq]``). Pass a buffer of at least ``seq + 1`` states in ``states`` to reuse memory across calls:
    keeping freshly allocated 1 MiB tensors alive costs page faults that make the loop several times slower.
    Shapes: ``query``/``key`` ``[batch, seq, k_heads, d_k]``, ``value`` ``[batch, seq, v_heads, d_v]``,
    ``g``/``beta`` ``[batch, seq, v_heads]``.
    """
    initial_dtype = query.dtype
    sequence_length = key.shape[1]
    query, key, value, beta, decay = _kernel_inputs(query, key, value, beta, g, use_qk_l2norm_in_kernel)
    query = query / (query.shape[-1] ** 0.5)

    state_shape = (sequence_length + 1, *initial_state.shape)
    if states is None or states.shape[0] < state_shape[0] or states.shape[1:] != initial_state.shape:
        states = torch.empty(state_shape, dtype=value.dtype, device=value.device)
    states = states[: sequence_length + 1]
    states[0].copy_(initial_state)
    core_attn_out = torch.zeros_like(value)
    for i in range(sequence_length):
        q_t, k_t, v_t = query[:, :, i], key[:, :, i], value[:, :, i]
        decay_t = decay[:, :, i].exp()[..., None, None]
        state = torch.mul(states[i], decay_t, out=states[i + 1])
        beta_t = beta[:, :, i].unsqueeze(-1)
        kv_mem = (state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta_t
        state.add_(k_t.unsqueeze(-1) * delta.unsqueeze(-2))
        core_attn_out[:, :, i] = (state * q_t.unsqueeze(-1)).sum(dim=-2)
    core_attn_out = core_attn_out.transpose(1, 2).contiguous().to(initial_dtype)
    return core_attn_out, states[sequence_length], states


@dataclass
class WindowFactors:
    """What `gated_delta_rule_window` keeps to rebuild the recurrent state after any position of its window.

    All fp32, per ``[batch, v_heads]``: ``initial`` the state before the window ``[.., d_k, d_v]``, ``key`` the
    normalised keys ``[.., T, d_k]``, ``log_decay`` the cumulative log decay ``G`` ``[.., T]`` and ``v_new`` the
    delta-rule corrections ``[.., T, d_v]``. The state after ``i`` tokens is
    ``exp(G[i-1]) * initial + sum_{j<i} exp(G[i-1] - G[j]) * key[j]^T v_new[j]``.
    """

    initial: torch.Tensor
    key: torch.Tensor
    log_decay: torch.Tensor
    v_new: torch.Tensor

    def state_at(self, i: int) -> torch.Tensor:
        """The fp32 recurrent state ``[batch, v_heads, d_k, d_v]`` after the first ``i`` tokens of the window."""
        if i == 0:
            return self.initial
        g_i = self.log_decay[..., i - 1 : i]
        weights = (g_i - self.log_decay[..., :i]).exp().unsqueeze(-1)
        return (
            self.initial * g_i.exp().unsqueeze(-1)
            + (self.key[..., :i, :] * weights).transpose(-1, -2) @ (self.v_new[..., :i, :])
        )


def gated_delta_rule_window(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, WindowFactors]:
    """The gated delta rule over a short window in closed form, returning ``(output, final_state, factors)``.

    This is the chunked formulation of transformers' ``torch_chunk_gated_delta_rule`` (UT transform: one
    ``T x T`` unit-triangular solve per head) applied to the window as a single chunk, without padding it to 64
    tokens. It reads and writes the ``[d_k, d_v]`` state a constant number of times instead of five times per
    token, so for 2..16 tokens it costs a fraction of the token-by-token loop, and ``factors.state_at(i)``
    rebuilds the state after any position in one pass, for rollback. It agrees with the token-by-token recurrence
    to float32 rounding (~1e-7 on states of norm ~1). Shapes as in `recurrent_gated_delta_rule_with_states`.
    """
    initial_dtype = query.dtype
    _, length, _, k_head_dim = key.shape
    v_head_dim = value.shape[-1]
    query, key, value, beta, g = _kernel_inputs(query, key, value, beta, g, use_qk_l2norm_in_kernel)
    query = query * k_head_dim**-0.5

    log_decay = g.cumsum(dim=-1)  # G_i: log of the decay from the window start through token i
    future = torch.ones(length, length, dtype=torch.bool, device=query.device).triu(1)
    pairwise = (log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()
    k_beta = key * beta.unsqueeze(-1)
    v_beta = value * beta.unsqueeze(-1)
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    rhs = torch.cat([v_beta, k_beta * log_decay.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(ut_system, rhs, upper=False, unitriangular=True)
    new_values, k_cumdecay = solved[..., :v_head_dim], solved[..., v_head_dim:]

    initial = initial_state.to(torch.float32).clone()  # the cache overwrites its state tensor in place
    v_new = new_values - k_cumdecay @ initial
    attn = (query @ key.transpose(-1, -2)) * pairwise
    core_attn_out = (query * log_decay.exp().unsqueeze(-1)) @ initial + attn @ v_new
    factors = WindowFactors(initial=initial, key=key, log_decay=log_decay, v_new=v_new)
    final = factors.state_at(length)
    core_attn_out = core_attn_out.transpose(1, 2).contiguous().to(initial_dtype)
    return core_attn_out, final, factors


@dataclass
class _KeptStates:
    """Per-position states written by `recurrent_gated_delta_rule_with_states` (views of a reused buffer)."""

    states: torch.Tensor

    def state_at(self, i: int) -> torch.Tensor:
        return self.states[i]


StateSource = WindowFactors | _KeptStates


class _Recorder:
    """Runs the GDN layers of one model forward with a kernel that can restore the state after any position.

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
        common = dict(
            g=kwargs["g"],
            beta=kwargs["beta"],
            initial_state=initial_state,
            use_qk_l2norm_in_kernel=bool(kwargs.get("use_qk_l2norm_in_kernel", False)),
        )
        length = args[1].shape[1]
        # The model hands q/k/v as strided views whose layout depends on the token count; reductions over them
        # round by layout, so a dense copy makes each token's arithmetic that of a one-token step.
        args = tuple(a.contiguous() for a in args)
        common["g"], common["beta"] = common["g"].contiguous(), common["beta"].contiguous()
        source: StateSource
        if self.kernel == "window" and length > 1:
            out, final, source = gated_delta_rule_window(*args, **common)
        else:
            buffer = self.buffers.get(layer)
            if buffer is None or buffer.shape[0] < length + 1 or buffer.shape[1:] != initial_state.shape:
                shape = (length + 1, *initial_state.shape)
                buffer = self.buffers[layer] = torch.empty(shape, dtype=torch.float32, device=initial_state.device)
            out, final, states = recurrent_gated_delta_rule_with_states(*args, **common, states=buffer)
            source = _KeptStates(states)
        self.sources[layer] = source
        return out, (final if kwargs.get("output_final_state", False) else None)


def _make_conv_dispatcher(original: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for the GDN conv: inside a decode-matched recording forward of several tokens, each new column
    is computed by the call a one-token step makes (its conv history and itself, contiguous), so that the conv's
    reduction does not depend on how many tokens the forward feeds."""

    @functools.wraps(original)
    def conv(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        recorder = _ACTIVE_RECORDER.get()
        if recorder is None or recorder.width == 1 or not decode_matched.active():
            return original(x, *args, **kwargs)
        history = x.shape[-1] - recorder.width
        kept = max(history, args[0].shape[-1])  # the conv state a one-token step sees grows to the kernel width
        columns = []
        for t in range(recorder.width):
            seen = min(history + t, kept)
            window = x[..., history + t - seen : history + t + 1].contiguous()
            columns.append(original(window, *args, **kwargs)[..., -1:])
        return torch.cat([x.new_zeros((*x.shape[:-1], history)), *columns], dim=-1)

    return conv


_ACTIVE_RECORDER: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar("_ACTIVE_RECORDER", default=None)
_PATCH_LOCK = threading.Lock()
_PATCH_COUNT: dict[str, int] = {}
_ORIGINALS: dict[tuple[str, str], Callable[..., Any]] = {}


def _make_dispatcher(original: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for a GDN kernel: the recording kernel while a recorder is active here, else ``original``."""

    @functools.wraps(original)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        recorder = _ACTIVE_RECORDER.get()
        if recorder is None:
            return original(*args, **kwargs)
        return recorder.run(args, kwargs)

    return dispatch


@contextlib.contextmanager
def _kernels_patched(modules: Sequence[ModuleType]) -> Iterator[None]:
    """Install the dispatchers in ``modules`` for the duration of the block (reference-counted, thread-safe)."""
    with _PATCH_LOCK:
        for module in modules:
            count = _PATCH_COUNT.get(module.__name__, 0)
            if count == 0:
                for name in (*_KERNEL_NAMES, _CONV_NAME):
                    original = getattr(module, name)
                    _ORIGINALS[module.__name__, name] = original
                    make = _make_conv_dispatcher if name == _CONV_NAME else _make_dispatcher
                    setattr(module, name, make(original))
            _PATCH_COUNT[module.__name__] = count + 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            for module in modules:
                count = _PATCH_COUNT[module.__name__] - 1
                _PATCH_COUNT[module.__name__] = count
                if count == 0:
                    for name in (*_KERNEL_NAMES, _CONV_NAME):
                        setattr(module, name, _ORIGINALS.pop((module.__name__, name)))


# --------------------------------------------------------------------------------------------------------------
# The target


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
            missing = [name for name in (*_KERNEL_NAMES, _CONV_NAME) if not callable(getattr(module, name, None))]
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
        self._tokens: list[int] = []
        self._window: _Window | None = None
        self._buffers: dict[int, torch.Tensor] = {}
        """Per GDN cache layer, storage for the per-position states of a forward (grows to the widest one)."""
        self._uncommitted = False
        """True while linear layers keep conv history from the last forward (trimmed by ``crop(0)``)."""

    # -- Target protocol (vocab_size, max_positions, length, cache: see CausalLMTarget) ------------------

    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor:
        self._check_prefill(token_ids)
        self._reset()
        try:
            logits = self._run(token_ids, logits_to_keep=1)[-1]
        except BaseException:
            self._invalidate()
            raise
        self._tokens = [int(t) for t in token_ids]
        self._uncommitted = True
        self._commit()
        return logits

    def forward(self, token_ids: Sequence[int]) -> torch.Tensor:
        self._check_forward(token_ids)
        self._commit()
        try:
            logits = self._forward_keeping_window(token_ids)
        except BaseException:
            self._invalidate()  # the cache may hold a partial update
            raise
        self._tokens.extend(int(t) for t in token_ids)
        self._uncommitted = True
        return logits

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot roll back to length {length}: the cache holds {self._length} tokens")
        if self._cache is None:
            return
        window = self._window
        if length == self._length:
            self._commit()
        elif window is not None and length >= window.start and window.sources is not None:
            with torch.inference_mode():
                for layer, source in window.sources.items():
                    self._recurrent(layer).copy_(source.state_at(length - window.start))
                self._cache.crop(length - self._length)
            self._set_length(length)
        elif window is not None and length >= window.start:
            replay = self._tokens[window.start : length]
            with torch.inference_mode():
                for layer, state in window.snapshot.items():
                    self._recurrent(layer).copy_(state)
                self._cache.crop(window.start - self._length)
            self._set_length(window.start)
            if replay:
                self.forward(replay)
                self._commit()
        else:
            history = self._tokens[:length]
            self._reset()
            if history:
                try:
                    self._run(history, logits_to_keep=1)
                except BaseException:
                    self._invalidate()
                    raise
                self._tokens = history
                self._uncommitted = True
                self._commit()

    # -- internals -------------------------------------------------------------------------------------------

    def _forward_keeping_window(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Run ``token_ids`` and set the window that rollback will use (recorded states or a snapshot)."""
        start = self._length
        if start == 0:  # nothing cached (after rollback(0)): no state to record from; rollback re-prefills
            return self._run(token_ids, logits_to_keep=0)
        if len(token_ids) > self.max_recorded and not self.decode_matched:
            with torch.inference_mode():
                snapshot = {i: self._recurrent(i).clone() for i in self._linear_layers()}
            logits = self._run(token_ids, logits_to_keep=0)
            self._window = _Window(start=start, snapshot=snapshot)
            return logits
        recorder = _Recorder(self._layer_of_state(), self._buffers, self.kernel, len(token_ids))
        context = _ACTIVE_RECORDER.set(recorder)
        try:
            with _kernels_patched(self._modules):
                logits = self._run(token_ids, logits_to_keep=0, matched=True)
        finally:
            _ACTIVE_RECORDER.reset(context)
        if set(recorder.sources) != set(self._linear_layers()):
            raise RuntimeError("not every Gated DeltaNet layer ran the recording kernel")
        self._window = _Window(start=start, sources=recorder.sources)
        return logits

    def _invalidate(self) -> None:
        """Drop the cache after a failed forward; the next call must be ``prefill``."""
        self._cache = None
        self._length = 0
        self._tokens = []
        self._window = None
        self._uncommitted = False

    def _reset(self) -> None:
        """Start from an empty cache that records conv history so that it can be cropped."""
        self._new_cache()
        self._tokens = []
        self._window = None
        self._uncommitted = False

    def _commit(self) -> None:
        """Forget the rollback window of the last forward and trim the conv history it needed."""
        if self._cache is not None and self._uncommitted:
            with torch.inference_mode():
                self._cache.crop(0)
        self._uncommitted = False
        self._window = None

    def _set_length(self, length: int) -> None:
        self._length = length
        del self._tokens[length:]
        self._window = None
        self._uncommitted = False

    def _linear_layers(self) -> list[int]:
        assert self._cache is not None
        return [i for i, layer in enumerate(self._cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]

    def _recurrent(self, layer: int) -> torch.Tensor:
        assert self._cache is not None
        state = self._cache.layers[layer].recurrent_states[0]
        assert state is not None
        return state

    def _layer_of_state(self) -> dict[int, int]:
        return {id(self._recurrent(i)): i for i in self._linear_layers()}
