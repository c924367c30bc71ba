"""GGUF's quantized weights (Q8_0, Q4_0, Q4_1) kept in their blocks and computed by our row products.

Why: people who run models on CPUs keep them quantized (the default model itself ships as a Q4_1 GGUF), and a
decode step at the sizes they run is a read of the weights. Dequantizing at load reads 4-7x the bytes of the file.

What: GGUF stores a quantized ``[out, in]`` weight as rows of blocks of 32 inputs, each one float16 scale ``d``
(Q4_1: and a float16 minimum ``m``) and 32 quants (Q8_0 ``d*q``, Q4_0 ``d*(q-8)``, Q4_1 ``d*q+m``). `quant_pack`
lays the same bytes out for the native product (``csrc/quant_linear.cpp``): per 16 outputs and 32 inputs one
superblock with the 16 outputs' scales (and minimums), then the quants in groups of 4 inputs, each output's 4 side
by side, the lanes of an integer dot product. The product quantizes each row's inputs to 8 bits per block of 32
(as llama.cpp does), takes exact integer dots per block and sums the scaled dots per output in input order: every
row the same at any width and in every build (AVX2, AVX512, VNNI), with a quarter (Q4) to a half (Q8_0) of
bfloat16's reads. A quantized model is thus its own model, close to the file dequantized to float32 but not equal
to it (its inputs are rounded to 8 bits): plain decoding of it is the reference its speculation equals.
`dequantize` gives GGUF's reference values (what `lattice_inference.quantized` matches layers by).
"""

from __future__ import annotations

import torch

FORMATS: dict[str, tuple[int, int]] = {"Q8_0": (34, 544), "Q4_0": (18, 288), "Q4_1": (20, 320)}
"""GGUF quantization -> (bytes of one GGUF block of 32 weights, bytes of one `quant_pack` superblock of 32 x 16)."""

BLOCK = 32
"""Weights per GGUF block (inputs of one output sharing a scale)."""


def quant_format(packed: torch.Tensor) -> str | None:
    """The GGUF quantization of a `quant_pack`ed weight (``"Q8_0"``, ``"Q4_0"``, ``"Q4_1"``), else None."""
    if packed.dim() != 3 or packed.dtype != torch.uint8:
        return None
    return next((name for name, (_, size) in FORMATS.items() if packed.shape[2] == size), None)


def _blocks(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """``raw`` (uint8 ``[out, in / 32 * block bytes]``, a GGUF tensor's data) as ``[out, in / 32, block bytes]``."""
    if kind not in FORMATS:
        raise ValueError(f"unsupported GGUF quantization {kind!r}; natively computed: {', '.join(FORMATS)}")
    size = FORMATS[kind][0]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % size:
        raise ValueError(f"a {kind} tensor is uint8 [out, blocks * {size}], got {raw.dtype} {list(raw.shape)}")
    return raw.reshape(raw.shape[0], -1, size)


def _halves(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 value at byte ``start`` of every block, ``[out, blocks]``."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).squeeze(-1)


def _quants(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """Every block's 32 quants in input order, ``[out, blocks, 32]``: int8 for Q8_0, 0..15 (uint8) for Q4."""
    if kind == "Q8_0":
        return blocks[..., 2:].contiguous().view(torch.int8)
    nibbles = blocks[..., -16:]  # byte j holds input j (low nibble) and input j + 16 (high nibble)
    return torch.cat([nibbles & 15, nibbles >> 4], dim=-1)


_DEQUANTIZE_ROWS = 4096  # a multiple of 16


def dequantize(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """A GGUF tensor's data (uint8 ``[out, bytes]``) as the float32 ``[out, in]`` weight GGUF's reference
    dequantization gives (``gguf.quants.dequantize``), bit for bit; in slices of rows, so that the float
    intermediates stay small beside the result (a 49152-row embedding's are 0.4 GB each at 2048 inputs)."""
    if raw.shape[0] > _DEQUANTIZE_ROWS:
        out = torch.empty(raw.shape[0], raw.shape[1] // FORMATS[kind][0] * BLOCK)
        for start in range(0, raw.shape[0], _DEQUANTIZE_ROWS):
            out[start : start + _DEQUANTIZE_ROWS] = dequantize(raw[start : start + _DEQUANTIZE_ROWS], kind)
        return out
    blocks = _blocks(raw, kind)
    d = _halves(blocks, 0).float().unsqueeze(-1)
    q = _quants(blocks, kind).float()
    if kind == "Q4_0":
        q = q - 8.0
    values = d * q  # exact: an 11-bit scale times a quant of at most 8 bits
    if kind == "Q4_1":
        values = values + _halves(blocks, 2).float().unsqueeze(-1)
    return values.reshape(raw.shape[0], -1)


def quant_pack(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """A GGUF tensor's data (uint8 ``[out, bytes]``, ``out`` a multiple of 16) laid out for ``quant_linear``:
    uint8 ``[out / 16, in / 32, superblock]`` (see the module docstring); in slices of rows, as `dequantize`."""
    if raw.shape[0] > _DEQUANTIZE_ROWS and raw.shape[0] % 16 == 0:
        return torch.cat([quant_pack(part, kind) for part in raw.split(_DEQUANTIZE_ROWS)])
    blocks = _blocks(raw, kind)
    out, count = blocks.shape[:2]
    if out % 16:
        raise ValueError(f"a quantized weight's outputs must be a multiple of 16, got {out}")
    groups = out // 16

    def side_by_side(per_output: torch.Tensor) -> torch.Tensor:  # [out, blocks, ...] -> [groups, blocks, ..., 16]
        moved = per_output.reshape(groups, 16, count, *per_output.shape[2:])
        return moved.movedim(1, -1)

    def as_bytes(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8).reshape(groups, count, -1)

    parts = [as_bytes(side_by_side(_halves(blocks, 0)))]
    if kind == "Q4_1":
        parts.append(as_bytes(side_by_side(_halves(blocks, 2))))
    q = side_by_side(_quants(blocks, kind))  # [groups, blocks, 32 inputs, 16 outputs]
    lanes = q.reshape(groups, count, 8, 4, 16).transpose(-1, -2)  # [.., 8 groups of 4 inputs, 16 outputs, 4]
    if kind == "Q8_0":
        parts.append(as_bytes(lanes))
    else:  # chunk c: group c in the low nibbles, group c + 4 in the high ones
        parts.append(as_bytes(lanes[:, :, :4] | (lanes[:, :, 4:] << 4)))
    packed = torch.cat(parts, dim=-1)
    assert packed.shape[-1] == FORMATS[kind][1]
    return packed


def concat_packed(parts: list[torch.Tensor]) -> torch.Tensor:
    """Several `quant_pack`ed weights of one format and input size as one (their outputs one after another):
    what a fused product (q/k/v, gate/up) runs over."""
    kinds = {quant_format(p) for p in parts}
    if len(kinds) != 1 or None in kinds or len({p.shape[1] for p in parts}) != 1:
        raise ValueError("quantized weights fuse only with the same format and input size")
    return torch.cat(parts)
