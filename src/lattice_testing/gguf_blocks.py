"""GGUF blocks of every format our products compute, written from float32 weights: test files without llama.cpp.

gguf-py quantizes Q8_0, Q4_0 and Q4_1 (its reference quantizers, used here for those), not Q5_0, Q5_1 or the
K-quants. For those this module makes valid blocks by a plain rounding (scales from each block's range, quants
rounded to nearest; not llama.cpp's searched scales, which only change which valid blocks come out): enough for a
weight close to the original, laid out byte for byte as ggml-common.h defines each block, so that gguf-py's
dequantization and ours read the same values from it.
"""

from __future__ import annotations

import numpy as np
import torch


def _half(values: np.ndarray) -> np.ndarray:
    """float16 bytes of ``values`` ``[..., 1]`` -> ``[..., 2]`` uint8."""
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape[:-1], 2)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Quants ``[..., 32]`` (0..15) as 16 bytes: byte j holds quant j (low) and j + 16 (high)."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def _q5(w: np.ndarray, with_min: bool) -> np.ndarray:
    blocks = w.reshape(w.shape[0], -1, 32)
    if with_min:
        low, high = blocks.min(-1, keepdims=True), blocks.max(-1, keepdims=True)
        d = ((high - low) / 31).astype(np.float16).astype(np.float32)
        inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0)
        q = np.clip(np.rint((blocks - low) * inv), 0, 31).astype(np.uint32)
        head = [_half(d), _half(low)]
    else:
        amax = np.abs(blocks).max(-1, keepdims=True)
        d = (amax / 15).astype(np.float16).astype(np.float32)
        inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0)
        q = np.clip(np.rint(blocks * inv) + 16, 0, 31).astype(np.uint32)
        head = [_half(d)]
    high = ((q >> 4) << np.arange(32, dtype=np.uint32)).sum(-1, keepdims=True).astype(np.uint32)
    parts = [*head, high.view(np.uint8).reshape(*q.shape[:-1], 4), _nibbles((q & 15).astype(np.uint8))]
    return np.concatenate(parts, axis=-1).reshape(w.shape[0], -1)


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins ``[..., 8]`` as Q4_K's 12 bytes (the inverse of ``get_scale_min_k4``)."""
    low = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    mid = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    top = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return np.concatenate([low, mid, top], axis=-1).astype(np.uint8)


def _qk(w: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (``bits`` 4) or Q5_K (5) blocks of ``w``: per sub-block of 32 a 6-bit scale and min of d and dmin."""
    levels = (1 << bits) - 1
    sub = w.reshape(w.shape[0], -1, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - low) / levels
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    dmin = (-low.min(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(-low / np.where(dmin > 0, dmin, 1)), 0, 63).astype(np.uint8)
    step = (d * sc)[..., None]
    q = np.rint((sub + (dmin * mn)[..., None]) / np.where(step > 0, step, 1))
    q = np.clip(q, 0, levels).astype(np.uint8).reshape(*sub.shape[:2], 4, 2, 32)  # 64-input chunks, 2 sub-blocks
    qs = (q[..., 0, :] & 15) | ((q[..., 1, :] & 15) << 4)  # [out, blocks, 4, 32]
    parts = [_half(d), _half(dmin), _k_scale_bytes(sc, mn)]
    if bits == 5:
        fifth = (q >> 4).reshape(*sub.shape[:2], 8, 32)  # sub-block j's bit j of byte l
        parts.append((fifth << np.arange(8, dtype=np.uint8)[:, None]).sum(-2).astype(np.uint8))
    parts.append(qs.reshape(*sub.shape[:2], 128))
    return np.concatenate(parts, axis=-1).reshape(w.shape[0], -1)


def _q6k(w: np.ndarray) -> np.ndarray:
    sub = w.reshape(w.shape[0], -1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)), -127, 127).astype(np.int8)
    step = (d * sc)[..., None]
    q = np.clip(np.rint(sub / np.where(step != 0, step, 1)), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(*sub.shape[:2], 2, 4, 32)  # halves of 128: 4 rows of 32
    ql = np.concatenate([q[..., 0, :] | (q[..., 2, :] << 4), q[..., 1, :] | (q[..., 3, :] << 4)], axis=-1)
    qh = (q[..., 0, :] >> 4) | ((q[..., 1, :] >> 4) << 2) | ((q[..., 2, :] >> 4) << 4) | ((q[..., 3, :] >> 4) << 6)
    parts = [ql.reshape(*sub.shape[:2], 128), qh.reshape(*sub.shape[:2], 64), sc.view(np.uint8), _half(d)]
    return np.concatenate(parts, axis=-1).reshape(w.shape[0], -1)


def quantize(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """A float32 ``[out, in]`` weight as GGUF ``kind`` blocks, uint8 ``[out, bytes]`` (``in`` a multiple of 32, or of
    256 for the K-quants)."""
    import gguf

    w = weight.detach().float().numpy()
    if kind in ("Q8_0", "Q4_0", "Q4_1"):
        return torch.from_numpy(gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, kind)))
    if kind in ("Q5_0", "Q5_1"):
        return torch.from_numpy(_q5(w, with_min=kind == "Q5_1"))
    if kind in ("Q4_K", "Q5_K"):
        return torch.from_numpy(_qk(w, 4 if kind == "Q4_K" else 5))
    if kind == "Q6_K":
        return torch.from_numpy(_q6k(w))
    raise ValueError(f"no writer for GGUF type {kind!r}")
