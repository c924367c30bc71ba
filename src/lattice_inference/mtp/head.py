"""The Qwen3-Next / Qwen3.5 MTP head: one forward, its KV cache, catch-up and chained drafting.

The math follows the references exactly (vLLM ``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py``, transformers' Qwen3-Next
and Qwen3.5 decoder layers):

    e = E[token];  x = W_fc @ [gnorm(e), gnorm(h_prev)]        # embedding FIRST; gnorm = x*rsqrt(mean x²+eps)*(1+w)
    one decoder layer with full attention:
        q_proj per head [query | gate]; q/k (1+w) norm, then partial NeoX RoPE on the first rotary_dim dims;
        GQA (head h reads kv head h // (n_h / n_kv)); scale head_dim^-0.5; o = attn * sigmoid(gate); o_proj
        MoE: fp32 softmax -> top-k -> renormalise, SwiGLU experts (gate rows first), sigmoid(w·y) shared expert;
        or a dense SwiGLU MLP
    h = gnorm(x, mtp.norm);  logits = lm_head @ h               # h (post-norm) is what the next step chains

All seven RMSNorms are the zero-centred ``(1 + w)`` kind and run in float32; the router softmax and the attention
softmax run in float32; matmuls run in the weights' dtype (float32 or bfloat16), mirroring transformers.

Pairing and positions (vLLM's convention): a call with the target's post-final-norm hidden ``h_t``
of position ``t`` takes the token ``x_{t+1}`` and the position ``t`` and predicts ``x_{t+2}``. So MTP cache slot ``p``
always holds the entry built from ``(h_p, x_{p+1})``, and a position must equal the current cache length.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from lattice_inference.errors import ConfigError, TokenError
from lattice_inference.kernels.packed_linear import pack_weight, packable, packed_linear
from lattice_inference.mtp.config import MtpConfig
from lattice_inference.mtp.layer import LayerTensors, Linear, gqa_attention, mtp_layer, rope_inv_freq, swiglu
from lattice_inference.mtp.weights import MtpWeights
from lattice_inference.sampling import top_tokens

_INITIAL_CAPACITY = 256

Tokens = Sequence[int] | torch.Tensor
Rank = Callable[[torch.Tensor, int, "torch.Tensor | None", int], list[int]]
"""``rank(scores, index, token_ids, count)``: the ``count`` best draft tokens for sequence index ``index`` from the
head's scores over ``token_ids`` (None: the whole vocabulary), best first (`Sampler.rank_draft`)."""


class DraftStep(NamedTuple):
    """One step of the head's draft chain."""

    token: int
    """The drafted token (the one the chain continues from)."""
    confidence: float
    """The head's probability of its most likely token over the draft vocabulary (EAGLE-2's acceptance signal)."""
    runners_up: tuple[int, ...] = ()
    """The next-best tokens for the same index, best first (as many as asked for): a draft tree verifies them
    beside ``token``."""


def _is_int(value: object) -> bool:
    """True for Python and numpy integers, False for bools and everything else."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class MtpCache:
    """One sequence's position-indexed, single-layer MTP KV cache: slot ``p`` holds the keys and values built from
    ``(h_p, x_{p+1})``; ``length`` slots are filled. Grows on demand up to ``max_seq_len``."""

    def __init__(self, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device, max_seq_len: int | None):
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0
        self.max_seq_len = max_seq_len

    def reserve(self, needed: int) -> None:
        """Room for ``needed`` slots (the filled ones kept)."""
        cap = self.k.shape[0]
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap)
        if self.max_seq_len is not None:
            new_cap = min(new_cap, self.max_seq_len)
        for old, name in ((self.k, "k"), (self.v, "v")):
            grown = torch.zeros((new_cap, *old.shape[1:]), dtype=old.dtype, device=old.device)
            grown[: self.length] = old[: self.length]
            setattr(self, name, grown)

    def rollback_to(self, n: int) -> None:
        """Keep only slots ``0..n-1`` (``0 <= n <= length``)."""
        if not _is_int(n) or not 0 <= n <= self.length:
            raise ValueError(f"cannot roll the MTP cache back to {n!r}: it holds {self.length} entries")
        self.length = int(n)


class MtpHead:
    """One MTP head (its weights) with its own position-indexed, single-layer KV cache, ``cache``.

    A drafter drafting several sequences with one head gives each its own cache (`new_cache`, passed to
    `draft_steps`); every other method works on ``cache``.

    Build it with :func:`lattice_inference.mtp.load_mtp_head` (from a checkpoint) or directly from an
    ``MtpConfig`` and ``MtpWeights``. Calls must be contiguous with the cache: a forward at positions
    ``p..p+n-1`` requires ``p == cache_len`` and sets ``cache_len = p + n``. ``rollback_cache_to(n)`` keeps
    slots ``0..n-1``. Every input is validated before any state changes, so a rejected call changes nothing.
    """

    def __init__(self, config: MtpConfig, weights: MtpWeights, *, max_seq_len: int | None = None) -> None:
        config.validate()
        weights.validate(config)
        if max_seq_len is not None and max_seq_len <= 0:
            raise ConfigError(f"max_seq_len must be positive, got {max_seq_len}")
        self.config = config
        self.max_seq_len = max_seq_len
        self.dtype = weights.dtype
        self.device = weights.fc.device
        self.layout = weights.layout
        w = weights
        # q, k and v share one matmul; the rows split back into [q|gate per head], k, v.
        self._layer = LayerTensors.of(w)
        self._embed = w.embed_tokens
        self._lm_head = w.lm_head
        if config.is_moe:
            self._router = w.router
            self._experts_gate_up = w.experts_gate_up
            self._experts_down = w.experts_down
            self._mlp_gate_up = torch.cat([w.shared_gate, w.shared_up], dim=0)
            self._mlp_down = w.shared_down
            self._shared_expert_gate = w.shared_expert_gate
        else:
            self._mlp_gate_up = torch.cat([w.mlp_gate, w.mlp_up], dim=0)
            self._mlp_down = w.mlp_down
        self._linear: Linear = F.linear
        layer = self._layer
        matrices = (layer.fc, layer.qkv, layer.o, self._mlp_gate_up, self._mlp_down)
        if self.device.type == "cpu" and all(packable(m) for m in matrices):  # packed products read them faster
            self._layer = dataclasses.replace(
                layer, fc=pack_weight(layer.fc), qkv=pack_weight(layer.qkv), o=pack_weight(layer.o)
            )
            self._mlp_gate_up, self._mlp_down = pack_weight(self._mlp_gate_up), pack_weight(self._mlp_down)
            self._linear = packed_linear
        self._inv_freq = rope_inv_freq(config.rope_theta, config.rotary_dim, self.device)
        self._scale = config.head_dim**-0.5
        self.cache = self.new_cache()
        self._draft_ids: torch.Tensor | None = None
        self._draft_head: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------------ cache

    def new_cache(self) -> MtpCache:
        """An empty cache for one sequence."""
        cfg = self.config
        capacity = _INITIAL_CAPACITY if self.max_seq_len is None else min(_INITIAL_CAPACITY, self.max_seq_len)
        shape = (capacity, cfg.num_key_value_heads, cfg.head_dim)
        return MtpCache(shape, self.dtype, self.device, self.max_seq_len)

    @property
    def _k(self) -> torch.Tensor:
        return self.cache.k

    @property
    def _v(self) -> torch.Tensor:
        return self.cache.v

    @property
    def cache_len(self) -> int:
        """Number of filled cache slots; the next forward must start at this position."""
        return self.cache.length

    def reset_cache(self) -> None:
        """Empty the cache (start of a generation)."""
        self.cache.length = 0

    def rollback_cache_to(self, n: int) -> None:
        """Keep only cache slots ``0..n-1`` (``0 <= n <= cache_len``)."""
        self.cache.rollback_to(n)

    # ------------------------------------------------------------------------------------------ validation

    def _check_tokens(self, token_ids: Tokens) -> torch.Tensor:
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool or token_ids.dim() != 1:
                raise TokenError(
                    f"MTP token ids must be a 1-D integer tensor, got {token_ids.dtype} {list(token_ids.shape)}"
                )
            ids = token_ids.tolist()
        else:
            ids = list(token_ids)
        if not ids:
            raise TokenError("MTP forward needs at least one token")
        vocab = self.config.vocab_size
        for i, tok in enumerate(ids):
            if not _is_int(tok):
                raise TokenError(f"MTP token id must be an int, got {tok!r}")
            if tok < 0 or tok >= vocab:
                raise TokenError(f"MTP token_id {tok} out of range: must be in [0, vocab_size {vocab})")
            ids[i] = int(tok)
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _check_positions(self, positions: Tokens, n: int) -> int:
        pos = positions.tolist() if isinstance(positions, torch.Tensor) else list(positions)
        if len(pos) != n:
            raise ValueError(f"got {len(pos)} positions for {n} tokens")
        start = self.cache_len
        if pos != list(range(start, start + n)):
            raise ValueError(
                f"MTP positions must be contiguous with the cache: expected {start}..{start + n - 1} "
                f"(cache_len {start}), got {pos[:4]}{'...' if len(pos) > 4 else ''}"
            )
        if self.max_seq_len is not None and start + n > self.max_seq_len:
            raise ValueError(f"position {start + n - 1} >= max_seq_len {self.max_seq_len}: the MTP cache is full")
        return start

    def _check_hiddens(self, hiddens: torch.Tensor | Sequence[float], n: int, *, single: bool) -> torch.Tensor:
        h = self.config.hidden_size
        if not isinstance(hiddens, torch.Tensor):
            hiddens = torch.tensor(hiddens, dtype=torch.float32)
        if not hiddens.dtype.is_floating_point:
            raise ValueError(f"previous_hidden must be a floating tensor, got {hiddens.dtype}")
        expected = (h,) if single else (n, h)
        if tuple(hiddens.shape) != expected:
            what = "previous_hidden" if single else "hiddens"
            raise ValueError(f"{what} has shape {list(hiddens.shape)}, expected {list(expected)} (hidden_size {h})")
        return hiddens.reshape(n, h).to(device=self.device, dtype=self.dtype)

    # ------------------------------------------------------------------------------------------ forward

    @torch.inference_mode()
    def forward_one(
        self, token_id: int, position: int, previous_hidden: torch.Tensor | Sequence[float]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP step: ``(logits [V] float32, post-norm hidden [H] float32)``.

        ``previous_hidden`` is the target's post-final-norm hidden ``h_t`` at ``position = t`` (or the hidden this
        head returned for the previous position when chaining drafts); ``token_id`` is ``x_{t+1}``, the token that
        follows position ``t``. The logits predict ``x_{t+2}``. ``position`` must equal ``cache_len``.
        """
        if not _is_int(token_id):
            raise TokenError(f"MTP token_id must be an int, got {token_id!r}")
        if not _is_int(position):
            raise ValueError(f"MTP position must be an int, got {position!r}")
        ids = self._check_tokens([token_id])
        start = self._check_positions([position], 1)
        hid = self._check_hiddens(previous_hidden, 1, single=True)
        logits, out = self._forward(ids, start, hid, want_logits=True)
        assert logits is not None
        return logits[0], out[0]

    @torch.inference_mode()
    def forward_many(
        self,
        token_ids: Tokens,
        positions: Tokens,
        hiddens: torch.Tensor,
        *,
        return_logits: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Batched form of ``forward_one`` over ``n`` contiguous positions (same results as ``n`` single calls).

        Row ``i`` pairs ``hiddens[i]`` (target hidden at ``positions[i]``) with ``token_ids[i]`` (the token at
        ``positions[i] + 1``). Returns ``(logits [n, V] float32 or None, hiddens [n, H] float32)``; pass
        ``return_logits=False`` for cache catch-up, which needs no logits (they cost ``n * V * H``).
        """
        ids = self._check_tokens(token_ids)
        n = int(ids.shape[0])
        start = self._check_positions(positions, n)
        hid = self._check_hiddens(hiddens, n, single=False)
        return self._forward(ids, start, hid, want_logits=return_logits)

    def prefill(self, hiddens: torch.Tensor, next_tokens: Tokens, start_position: int) -> None:
        """Catch the cache up from target hiddens: slot ``start_position + i`` from ``(hiddens[i], next_tokens[i])``.

        After a target prefill of ``x_0..x_{P-1}`` (hiddens ``h_0..h_{P-1}``) call
        ``prefill(h[:P-1], x[1:P], 0)``; after a verification that accepted ``a`` drafts, call it with the
        accepted positions' target hiddens and the tokens that follow them.
        """
        ids = self._check_tokens(next_tokens)
        self.forward_many(ids, range(start_position, start_position + int(ids.shape[0])), hiddens, return_logits=False)

    def draft_tokens(
        self,
        next_token_id: int,
        position: int,
        hidden: torch.Tensor | Sequence[float],
        num_tokens: int | None = None,
        eos_token_ids: Sequence[int] = (),
        *,
        catch_up: tuple[torch.Tensor, Tokens] | None = None,
        choose: Callable[[torch.Tensor, int, torch.Tensor | None], int] | None = None,
    ) -> list[int]:
        """Draft up to ``num_tokens`` (default ``draft_length - 1``) tokens by chaining ``forward_one``.

        ``next_token_id`` is ``x_{t+1}`` (the target's argmax at ``position = t``) and ``hidden`` the target's
        post-norm ``h_t``. Step ``j`` feeds the previous draft with this head's own post-norm hidden at
        ``t + j``. Stops early after drafting an EOS. Drafts are argmax (first index on ties, like torch).

        ``catch_up=(hiddens [m, H], next_tokens [m])`` first fills slots ``t - m .. t - 1`` exactly as
        ``prefill(hiddens, next_tokens, t - m)`` would, inside the first draft step's forward (one forward per
        round fewer; logits are computed for the draft row only). Then ``t - m`` must equal ``cache_len``.

        ``choose(scores, index, token_ids)`` (default: argmax) picks draft ``j`` (sequence index ``t + 2 + j``)
        from the head's scores over the draft vocabulary ``token_ids`` (None: the whole vocabulary); coupled
        sampling passes the keyed sampler's `choose_draft` here.
        """
        count = self.config.num_drafts if num_tokens is None else num_tokens
        if count < 1:
            raise ValueError(f"num_tokens must be >= 1, got {count}")
        rank: Rank | None = None
        if choose is not None:
            pick = choose

            def rank(scores: torch.Tensor, index: int, ids: torch.Tensor | None, count: int) -> list[int]:
                return [pick(scores, index, ids)]

        steps = self.draft_steps(next_token_id, position, hidden, catch_up=catch_up, rank=rank, limit=count)
        eos = set(eos_token_ids)
        drafts: list[int] = []
        for step in steps:
            token = step.token
            drafts.append(token)
            if token in eos or len(drafts) == count:
                break
        steps.close()
        return drafts

    def draft_steps(
        self,
        next_token_id: int,
        position: int,
        hidden: torch.Tensor | Sequence[float],
        *,
        catch_up: tuple[torch.Tensor, Tokens] | None = None,
        rank: Rank | None = None,
        runners_up: int = 0,
        limit: int | None = None,
        cache: MtpCache | None = None,
    ) -> Generator[DraftStep, None, None]:
        """The draft chain of `draft_tokens`, one `DraftStep` per ``next``: the token, the head's confidence (its
        probability of its most likely token over the draft vocabulary, the signal EAGLE-2 uses to predict
        acceptance) and ``runners_up`` next-best tokens. A caller that stops early pays only for the steps it took,
        so it can look at the first draft's confidence before deciding to chain more. ``rank`` (default: by score)
        orders the draft tokens; coupled sampling passes the keyed sampler's `rank_draft`. Other arguments and
        checks as in `draft_tokens` (made when called, before the first step); ``limit`` caps the steps (default:
        up to ``max_seq_len``); ``cache``: the sequence's cache (default: the head's own).
        """
        if not _is_int(runners_up) or runners_up < 0:
            raise ValueError(f"runners_up must be a non-negative int, got {runners_up!r}")
        if not _is_int(next_token_id):
            raise TokenError(f"MTP token_id must be an int, got {next_token_id!r}")
        ids = self._check_tokens([next_token_id])
        hid = self._check_hiddens(hidden, 1, single=True)
        m = 0
        if catch_up is not None:
            up_ids = self._check_tokens(catch_up[1])
            m = int(up_ids.shape[0])
            ids = torch.cat([up_ids, ids])
            hid = torch.cat([self._check_hiddens(catch_up[0], m, single=False), hid])
        cache = self.cache if cache is None else cache
        if not _is_int(position) or position - m != cache.length:
            where = f"position {position!r}" if not m else f"position {position!r} minus {m} catch-up rows"
            raise ValueError(f"MTP {where} must equal cache_len {cache.length}")
        if limit is not None and self.max_seq_len is not None and position + limit > self.max_seq_len:
            raise ValueError(f"drafting {limit} tokens from position {position} passes max_seq_len {self.max_seq_len}")
        return self._chain(ids, position - m, hid, position, rank, 1 + runners_up, cache)

    @torch.inference_mode()
    def _chain(
        self,
        ids: torch.Tensor,
        pos: int,
        hid: torch.Tensor,
        position: int,
        rank: Rank | None,
        width: int,
        cache: MtpCache,
    ) -> Generator[DraftStep, None, None]:
        scorer = self._lm_head if self._draft_head is None else self._draft_head
        index = position + 2
        while self.max_seq_len is None or pos + int(ids.shape[0]) <= self.max_seq_len:
            _, out = self._forward(ids, pos, hid, want_logits=False, cache=cache)
            hid = out[-1:].to(self.dtype)  # exact: the head's own dtype, widened to float32 and back
            scores = (F.linear if scorer is self._lm_head else self._linear)(hid, scorer)[0]
            best = int(torch.argmax(scores))
            confidence = float(torch.softmax(scores.float(), dim=0)[best])
            if rank is None and width == 1:
                ranked = [best if self._draft_ids is None else int(self._draft_ids[best])]
            elif rank is None:
                ranked = top_tokens(scores, self._draft_ids, width)
            else:
                ranked = rank(scores, index, self._draft_ids, width)
            token = ranked[0]
            yield DraftStep(token, confidence, tuple(ranked[1:]))
            pos += int(ids.shape[0])
            index += 1
            ids = torch.tensor([token], dtype=torch.long, device=self.device)

    def set_draft_vocab(self, token_ids: Iterable[int] | torch.Tensor | None) -> None:
        """Restrict the argmax of ``draft_tokens`` to ``token_ids`` (None: the whole vocabulary again).

        Scoring a few tens of thousands of frequent tokens instead of the full vocabulary (FR-Spec, EAGLE-3's
        draft vocabulary) cuts the largest cost of a draft step, the ``lm_head``. It changes which tokens are
        drafted, never the output: every draft is verified by the target. ``forward_one`` / ``forward_many`` keep
        returning full-vocabulary logits. Ties go to the smallest id, as with ``torch.argmax`` on full logits.
        """
        if token_ids is None:
            self._draft_ids = None
            self._draft_head = None
            return
        ids = sorted(set(token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids))
        if not ids:
            raise TokenError("the draft vocabulary must hold at least one token id")
        vocab = self.config.vocab_size
        if ids[0] < 0 or ids[-1] >= vocab:
            bad = ids[0] if ids[0] < 0 else ids[-1]
            raise TokenError(f"draft vocabulary token id {bad} out of range: must be in [0, vocab_size {vocab})")
        index = torch.tensor(ids, dtype=torch.long, device=self.device)
        self._draft_ids = index
        rows = self._lm_head.index_select(0, index)
        self._draft_head = pack_weight(rows) if self._linear is packed_linear else rows

    def _forward(
        self, ids: torch.Tensor, start: int, hidden: torch.Tensor, *, want_logits: bool, cache: MtpCache | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        cfg = self.config
        kv = self.cache if cache is None else cache

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            n = k.shape[0]
            kv.reserve(start + n)
            kv.k[start : start + n] = k
            kv.v[start : start + n] = v
            return gqa_attention(q, kv.k[: start + n], kv.v[: start + n], start, self._scale)

        out = mtp_layer(
            self._layer,
            self._embed[ids],
            hidden,
            cfg,
            inv_freq=self._inv_freq,
            start=start,
            attend=attend,
            mlp=self._moe if cfg.is_moe else lambda y: swiglu(y, self._mlp_gate_up, self._mlp_down, self._linear),
            linear=self._linear,
        )
        kv.length = start + int(ids.shape[0])
        logits = F.linear(out, self._lm_head).float() if want_logits else None
        return logits, out.float()

    def _moe(self, y: torch.Tensor) -> torch.Tensor:
        """Routed experts (softmax fp32 -> top-k -> renormalise) plus the sigmoid-gated shared expert."""
        cfg = self.config
        router_logits = F.linear(y, self._router)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
        if cfg.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(y.dtype)
        out = torch.zeros_like(y)
        flat = top_i.tolist()
        by_expert: dict[int, list[tuple[int, int]]] = {}
        for row, experts in enumerate(flat):
            for slot, e in enumerate(experts):
                by_expert.setdefault(e, []).append((row, slot))
        for e in sorted(by_expert):
            rows = [r for r, _ in by_expert[e]]
            slots = [s for _, s in by_expert[e]]
            rows_t = torch.tensor(rows, device=y.device)
            h = swiglu(y[rows_t], self._experts_gate_up[e], self._experts_down[e])
            h = h * top_w[rows_t, torch.tensor(slots, device=y.device), None]
            out.index_add_(0, rows_t, h)
        shared = swiglu(y, self._mlp_gate_up, self._mlp_down, self._linear)
        return out + torch.sigmoid(F.linear(y, self._shared_expert_gate)) * shared
