"""The MTP layer's math, written once: drafting (`MtpHead`, with its KV cache) and training (`train.model`) call it.

Every function takes optional leading batch dimensions (``[..., n, H]``), uses only differentiable torch ops, and
keeps the numerics of ``MtpHead`` (float32 ``(1 + w)`` norms, float32 attention softmax, matmuls in the weights'
dtype), so a head trained through these functions drafts with exactly the function it was trained as.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from lattice_inference.mtp.config import MtpConfig


def gnorm(x: torch.Tensor, one_plus_w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm ``x * rsqrt(mean(x²) + eps) * (1 + w)`` in float32, cast back to ``x.dtype``.

    ``one_plus_w`` is the precomputed float32 ``1 + w`` (exactly transformers' ``1.0 + weight.float()``).
    """
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * one_plus_w).to(x.dtype)


def one_plus(w: torch.Tensor) -> torch.Tensor:
    """float32 ``1 + w`` of a zero-centred norm weight (transformers: ``1.0 + weight.float()``)."""
    return 1.0 + w.float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """NeoX pairing: element ``i`` pairs with ``i + d/2``."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_inv_freq(rope_theta: float, rotary_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Same expression as transformers' ``compute_default_rope_parameters`` (float32)."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim
    return (1.0 / (rope_theta**exponent)).to(device)


def apply_rope(t: torch.Tensor, inv_freq: torch.Tensor, start: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Partial NeoX RoPE of ``t [..., n, heads, hd]`` at positions ``start..start+n-1`` on the first
    ``2 * len(inv_freq)`` dims; cos/sin are built in float32 and cast to ``t``'s dtype, like transformers."""
    n = t.shape[-3]
    pos = torch.arange(start, start + n, device=t.device).float()
    freqs = pos[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(dtype or t.dtype)[:, None, :]
    sin = emb.sin().to(dtype or t.dtype)[:, None, :]
    rd = emb.shape[-1]
    rot, keep = t[..., :rd], t[..., rd:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, keep], dim=-1)


def gqa_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    scale: float,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of ``q [..., n, n_h, hd]`` (positions ``start..``) over ``keys``/``values``
    ``[..., L, n_kv, hd]`` (positions ``0..L-1``, ``L = start + n``); query head ``h`` reads kv head
    ``h // (n_h / n_kv)``. Softmax in float32. Returns ``[..., n, n_h * hd]``.

    ``allowed [n, L]`` (bool), when given, replaces the causal mask: training the chained draft steps lays
    several steps' keys side by side (`train.model.chain_mask`)."""
    *lead, n, n_h, hd = q.shape
    n_kv, total = keys.shape[-2], keys.shape[-3]
    groups = n_h // n_kv
    k = keys.movedim(-3, -1)  # [..., n_kv, hd, L]
    v = values.movedim(-3, -2)  # [..., n_kv, L, hd]
    qh = q.reshape(*lead, n, n_kv, groups, hd).movedim(-4, -2).reshape(*lead, n_kv, groups * n, hd)
    scores = torch.matmul(qh, k) * scale  # [..., n_kv, groups*n, L]
    if allowed is not None:
        scores = scores.masked_fill(~allowed.repeat(groups, 1), float("-inf"))
    elif n > 1:
        row = torch.arange(n, device=q.device).repeat(groups)[:, None] + start
        col = torch.arange(total, device=q.device)[None, :]
        scores = scores.masked_fill(col > row, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    ctx = torch.matmul(probs, v)  # [..., n_kv, groups*n, hd]
    return ctx.reshape(*lead, n_kv, groups, n, hd).movedim(-2, -4).reshape(*lead, n, n_h * hd)


Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``linear(x, weight) = x @ weight.T``: ``F.linear``, or `packed_linear` over oneDNN-packed weights (drafting on
a CPU, where it reads the weights faster)."""


def swiglu(y: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, linear: Linear = F.linear) -> torch.Tensor:
    """SwiGLU MLP with the gate rows first in ``gate_up``."""
    gu = linear(y, gate_up)
    inter = gu.shape[-1] // 2
    return linear(F.silu(gu[..., :inter]) * gu[..., inter:], down)


@dataclass(frozen=True)
class LayerTensors:
    """The tensors of one MTP layer as the math uses them: norms as float32 ``1 + w``, q/k/v rows fused
    (``[q|gate per head], k, v``). `MtpHead` builds it once; training rebuilds it every step (differentiably)."""

    pre_emb: torch.Tensor
    pre_hid: torch.Tensor
    fc: torch.Tensor
    w_in: torch.Tensor
    qkv: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: torch.Tensor
    w_post: torch.Tensor
    w_final: torch.Tensor

    @classmethod
    def of(cls, w: Any) -> LayerTensors:
        """From anything with the checkpoint's field names (`MtpWeights`, the trainable head's parameters)."""
        return cls(
            pre_emb=one_plus(w.pre_fc_norm_embedding),
            pre_hid=one_plus(w.pre_fc_norm_hidden),
            fc=w.fc,
            w_in=one_plus(w.input_layernorm),
            qkv=torch.cat([w.q_proj, w.k_proj, w.v_proj], dim=0),
            q_norm=one_plus(w.q_norm),
            k_norm=one_plus(w.k_norm),
            o=w.o_proj,
            w_post=one_plus(w.post_attention_layernorm),
            w_final=one_plus(w.norm),
        )


#: ``attend(q [..., n, n_h, hd], k [..., n, n_kv, hd], v) -> [..., n, n_h*hd]``: where the keys live (a cache or
#: the sequence itself) is the caller's business; the math is `gqa_attention`.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def mtp_layer(
    t: LayerTensors,
    emb: torch.Tensor,
    hidden: torch.Tensor,
    cfg: MtpConfig,
    *,
    inv_freq: torch.Tensor,
    start: int,
    attend: Attend,
    mlp: Callable[[torch.Tensor], torch.Tensor],
    linear: Linear = F.linear,
) -> torch.Tensor:
    """One MTP step over ``n`` rows: ``emb [..., n, H]`` (embedding of ``x_{t+1}``) and ``hidden [..., n, H]``
    (post-norm ``h_t``) at RoPE positions ``start..``; returns the post-norm output ``[..., n, H]`` that
    ``lm_head`` scores for ``x_{t+2}``. ``cfg`` gives the attention heads and the norms' epsilon; ``linear`` runs
    the projections ``fc``, ``qkv`` and ``o`` (their tensors in ``t`` are whatever it takes)."""
    n_h, n_kv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    x = linear(torch.cat([gnorm(emb, t.pre_emb, eps), gnorm(hidden, t.pre_hid, eps)], dim=-1), t.fc)
    # ---- attention
    residual = x
    y = gnorm(x, t.w_in, eps)
    qkv = linear(y, t.qkv)
    q_dim, kv_dim = 2 * n_h * hd, n_kv * hd
    qg = qkv[..., :q_dim].unflatten(-1, (n_h, 2 * hd))
    q, gate = qg[..., :hd], qg[..., hd:].flatten(-2)
    k = qkv[..., q_dim : q_dim + kv_dim].unflatten(-1, (n_kv, hd))
    v = qkv[..., q_dim + kv_dim :].unflatten(-1, (n_kv, hd))
    q = apply_rope(gnorm(q, t.q_norm, eps), inv_freq, start)
    k = apply_rope(gnorm(k, t.k_norm, eps), inv_freq, start)
    attn = attend(q, k, v)
    x = residual + linear(attn * torch.sigmoid(gate), t.o)
    # ---- MLP
    residual = x
    x = residual + mlp(gnorm(x, t.w_post, eps))
    return gnorm(x, t.w_final, eps)
