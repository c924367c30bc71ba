"""GGUF's quantized weights kept in their blocks and computed by our row products: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
and the K-quants Q4_K, Q5_K, Q6_K (every type of the Q4_K_M, Q5_K_M, Q6_K and Q8_0 files people download).

Why: people who run models on CPUs keep them quantized (the default model itself ships as a Q4_1 GGUF), and a
decode step at the sizes they run is a read of the weights. Dequantizing at load reads 4-7x the bytes of the file.

What: GGUF stores a quantized ``[out, in]`` weight as rows of blocks: of 32 inputs with one float16 scale ``d``
(Q4_1, Q5_1: and a float16 minimum ``m``) and 32 quants (Q8_0 ``d*q``, Q4_0 ``d*(q-8)``, Q5_0 ``d*(q-16)``, Q4_1 and
Q5_1 ``d*q+m``), or super-blocks of 256 (Q4_K, Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins of the float16
``d`` and ``dmin``, ``d*sc*q - dmin*m``; Q6_K: 16 sub-blocks of 16 with 8-bit scales, ``d*sc*(q-32)``). `unpack`
reads them (ggml-common.h's layouts); `quant_pack` lays the same values out for the native product
(``csrc/quant_linear.cpp``): per 16 outputs and 32 (256) inputs one superblock with the outputs' scales, then the
quants in groups of 4 inputs, each output's 4 side by side, the lanes of an integer dot product. The product
quantizes each row's inputs to 8 bits as llama.cpp does for the format (per 32 for the 32-formats, Q8_K per 256 for
the K-quants), takes exact integer dots and sums the scaled dots per output in input order: every row the same at
any width and in every build (AVX2, AVX512, VNNI), with a quarter (Q4) to a half (Q8_0) of bfloat16's reads. A
quantized model is thus its own model, close to the file dequantized to float32 but not equal to it (its inputs are
rounded to 8 bits): plain decoding of it is the reference its speculation equals. `dequantize` gives GGUF's
reference values bit for bit (what `lattice_inference.models.gguf_quantized` matches layers by).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class QuantFormat(NamedTuple):
    """One GGUF quantization as our products take it."""

    block_bytes: int
    """Bytes of one GGUF block (``inputs`` weights of one output)."""
    inputs: int
    """Weights per GGUF block: 32, or 256 for the K-quants (super-blocks of 8 or 16 sub-blocks)."""
    packed_bytes: int
    """Bytes of one `quant_pack` superblock (16 outputs times ``inputs``): names the format in ``csrc``."""


FORMATS: dict[str, QuantFormat] = {
    "Q8_0": QuantFormat(34, 32, 544),
    "Q4_0": QuantFormat(18, 32, 288),
    "Q4_1": QuantFormat(20, 32, 320),
    "Q5_0": QuantFormat(22, 32, 352),
    "Q5_1": QuantFormat(24, 32, 384),
    "Q4_K": QuantFormat(144, 256, 2368),
    "Q5_K": QuantFormat(176, 256, 2880),
    "Q6_K": QuantFormat(210, 256, 3360),
}
"""GGUF quantization -> how it is stored and packed; every type of a Q4_K_M, Q5_K_M, Q6_K or Q8_0 file."""


def columns(raw_bytes: int, kind: str) -> int:
    """The inputs of a GGUF ``kind`` tensor whose rows hold ``raw_bytes`` bytes."""
    fmt = FORMATS[kind]
    return raw_bytes // fmt.block_bytes * fmt.inputs


def quant_format(packed: torch.Tensor) -> str | None:
    """The GGUF quantization of a `quant_pack`ed weight (``"Q8_0"``, ``"Q4_K"``, ...), else None."""
    if packed.dim() != 3 or packed.dtype != torch.uint8:
        return None
    return next((name for name, fmt in FORMATS.items() if packed.shape[2] == fmt.packed_bytes), None)


def _blocks(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """``raw`` (uint8 ``[out, blocks * block bytes]``, a GGUF tensor's data) as ``[out, blocks, block bytes]``."""
    if kind not in FORMATS:
        raise ValueError(f"unsupported GGUF quantization {kind!r}; natively computed: {', '.join(FORMATS)}")
    size = FORMATS[kind].block_bytes
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % size:
        raise ValueError(f"a {kind} tensor is uint8 [out, blocks * {size}], got {raw.dtype} {list(raw.shape)}")
    return raw.reshape(raw.shape[0], -1, size)


def _halves(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 value at byte ``start`` of every block, ``[out, blocks]``."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).squeeze(-1)


def _bits(data: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """``(data >> shift) & mask`` for each shift, the shifts' results one after another on the last axis."""
    return torch.cat([(data >> s) & mask for s in shifts], dim=-1)


class Unpacked(NamedTuple):
    """A GGUF tensor's blocks as integers: ``q`` [out, blocks, inputs] (Q8_0 int8; others 0..15, 0..31 or 0..63 before
    their offset), the float16 scale ``d`` [out, blocks], the minimum ``m`` (Q4_1, Q5_1; the K-quants' ``dmin``), and
    the K-quants' sub-block ``scales`` and ``mins`` [out, blocks, 8 or 16] (Q6_K's scales int8)."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of Q4_K/Q5_K blocks from their 12 bytes (``get_scale_min_k4``)."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mins = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return scales, mins


def unpack(raw: torch.Tensor, kind: str) -> Unpacked:
    """GGUF's blocks of ``raw`` as `Unpacked` integers and scales (the layouts of ggml-common.h)."""
    blocks = _blocks(raw, kind)
    if kind == "Q8_0":
        return Unpacked(blocks[..., 2:].contiguous().view(torch.int8), _halves(blocks, 0))
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        head = 2 if kind in ("Q4_0", "Q5_0") else 4
        m = _halves(blocks, 2) if head == 4 else None
        nibbles = blocks[..., -16:]  # byte j holds input j (low nibble) and input j + 16 (high nibble)
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)
        if kind.startswith("Q5"):
            high = blocks[..., head : head + 4].unsqueeze(-1)  # bit i of byte j: input 8j + i's fifth bit
            fifth = (high >> torch.arange(8, dtype=torch.uint8)) & 1
            q = q | (fifth.reshape(q.shape) << 4)
        return Unpacked(q, _halves(blocks, 0), m)
    if kind in ("Q4_K", "Q5_K"):
        scales, mins = _k_scales(blocks[..., 4:16])
        qs = blocks[..., -128:].reshape(*blocks.shape[:2], 4, 32)  # 64 inputs per 32 bytes: low nibbles, then high
        q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(*blocks.shape[:2], 256)
        if kind == "Q5_K":
            high = blocks[..., 16:48]  # byte l, bit j: the fifth bit of input l of sub-block j
            q = q | (_bits(high, list(range(8)), 1) << 4)
        return Unpacked(q, _halves(blocks, 0), _halves(blocks, 2), scales, mins)
    # Q6_K: ql [128], qh [64], scales [16] int8, d
    ql = blocks[..., :128].reshape(*blocks.shape[:2], 2, 64)
    qh = blocks[..., 128:192].reshape(*blocks.shape[:2], 2, 32)
    low = torch.cat([ql & 15, ql >> 4], dim=-1)  # per half of 128: 4 rows of 32
    q = low | (_bits(qh, [0, 2, 4, 6], 3) << 4)
    scales = blocks[..., 192:208].contiguous().view(torch.int8)
    return Unpacked(q.reshape(*blocks.shape[:2], 256), _halves(blocks, 208), scales=scales)


_DEQUANTIZE_ROWS = 4096  # a multiple of 16


def dequantize(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """A GGUF tensor's data (uint8 ``[out, bytes]``) as the float32 ``[out, in]`` weight GGUF's reference
    dequantization gives (``gguf.quants.dequantize``), bit for bit; in slices of rows, so that the float
    intermediates stay small beside the result (a 49152-row embedding's are 0.4 GB each at 2048 inputs)."""
    if raw.shape[0] > _DEQUANTIZE_ROWS:
        out = torch.empty(raw.shape[0], columns(raw.shape[1], kind))
        for start in range(0, raw.shape[0], _DEQUANTIZE_ROWS):
            out[start : start + _DEQUANTIZE_ROWS] = dequantize(raw[start : start + _DEQUANTIZE_ROWS], kind)
        return out
    u = unpack(raw, kind)
    d = u.d.float().unsqueeze(-1)
    q = u.q.float()
    if u.scales is None:  # 32-formats; each product below exact (an 11-bit scale times a quant of at most 8 bits)
        offset = {"Q4_0": 8.0, "Q5_0": 16.0}.get(kind)
        values = d * (q - offset if offset else q)
        if u.m is not None:
            values = values + u.m.float().unsqueeze(-1)
    elif u.mins is not None:  # Q4_K, Q5_K: (d * scale) * q - dmin * min per sub-block of 32
        assert u.m is not None
        scale = (d * u.scales.float()).unsqueeze(-1)
        low = (u.m.float().unsqueeze(-1) * u.mins.float()).unsqueeze(-1)
        values = scale * q.reshape(*q.shape[:2], 8, 32) - low
    else:  # Q6_K: (d * scale) * (q - 32) per sub-block of 16
        scale = (d * u.scales.float()).unsqueeze(-1)
        values = scale * (q.reshape(*q.shape[:2], 16, 16) - 32.0)
    return values.reshape(raw.shape[0], -1)


def _lanes(q: torch.Tensor) -> torch.Tensor:
    """Quants ``[groups, parts, 32 inputs, 16 outputs]`` as the products read them: ``[groups, parts, 8 groups of 4
    inputs, 16 outputs, 4]`` (an output's 4 inputs side by side, one 32-bit lane of a dot product)."""
    return q.reshape(*q.shape[:2], 8, 4, 16).transpose(-1, -2)


def _nibble_chunks(q: torch.Tensor) -> torch.Tensor:
    """4-bit quants (`_lanes` order) as 4 chunks of 64 bytes: chunk c holds group c in its low nibbles and group
    c + 4 in its high ones."""
    lanes = _lanes(q & 15)
    return lanes[:, :, :4] | (lanes[:, :, 4:] << 4)


def _high_planes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """The bits above the nibble of each quant (`_lanes` order): one bit (Q5) as 64 bytes, bit g of byte i the fifth
    bit of group g's byte i; two bits (Q6_K) as two vectors of 64 bytes, bits 2c..2c+1 of byte i the high bits of group
    c (first vector) or c + 4 (second)."""
    high = _lanes(q >> 4)  # [groups, parts, 8, 16, 4], uint8 throughout

    def planes(groups: range, width: int) -> torch.Tensor:
        out = high[:, :, groups[0]].clone()
        for step, g in enumerate(groups[1:], 1):
            out |= high[:, :, g] << (width * step)
        return out

    if bits == 1:
        return planes(range(8), 1)
    return torch.stack([planes(range(4), 2), planes(range(4, 8), 2)], dim=2)


def quant_pack(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """A GGUF tensor's data (uint8 ``[out, bytes]``, ``out`` a multiple of 16) laid out for ``quant_linear``:
    uint8 ``[out / 16, in / inputs, superblock]`` (see the module docstring and ``csrc/quant_linear.cpp``): in one
    native pass where the native ops are built (a load packs every matrix of the file: 0.05 s against 1.2 s for a
    0.5B Q4_K_M file), else by `pack_reference`, whose bytes it equals."""
    from lattice_inference.kernels import native_ops

    _blocks(raw, kind)  # the format and the shape, checked as the reference checks them
    if raw.shape[0] % 16:
        raise ValueError(f"a quantized weight's outputs must be a multiple of 16, got {raw.shape[0]}")
    module = native_ops.ops() if native_ops.enabled() else None
    if module is None:
        return pack_reference(raw, kind)
    return module.quant_pack(raw.contiguous(), kind)


def pack_reference(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """`quant_pack` in PyTorch, from `unpack`'s integers (the layout's definition, which the native pass equals);
    in slices of rows, as `dequantize`."""
    if raw.shape[0] > _DEQUANTIZE_ROWS and raw.shape[0] % 16 == 0:
        return torch.cat([pack_reference(part, kind) for part in raw.split(_DEQUANTIZE_ROWS)])
    u = unpack(raw, kind)
    out, count = u.q.shape[:2]
    if out % 16:
        raise ValueError(f"a quantized weight's outputs must be a multiple of 16, got {out}")
    groups = out // 16

    def side_by_side(per_output: torch.Tensor) -> torch.Tensor:  # [out, blocks, ...] -> [groups, blocks, ..., 16]
        moved = per_output.reshape(groups, 16, count, *per_output.shape[2:])
        return moved.movedim(1, -1)

    def as_bytes(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8).reshape(groups, count, -1)

    parts = [as_bytes(side_by_side(u.d))]
    if u.m is not None:
        parts.append(as_bytes(side_by_side(u.m)))
    if u.scales is not None:  # [groups, blocks, sub-blocks, 16 outputs]
        parts.append(as_bytes(side_by_side(u.scales)))
    if u.mins is not None:
        parts.append(as_bytes(side_by_side(u.mins)))
    sub = u.q.shape[2] // 32
    q = side_by_side(u.q.reshape(out, count, sub, 32))  # [groups, blocks, sub, 32 inputs, 16 outputs]
    q = q.reshape(groups, count * sub, 32, 16)
    if kind == "Q8_0":
        parts.append(as_bytes(_lanes(q)))
    else:
        parts.append(as_bytes(_nibble_chunks(q).reshape(groups, count, sub, -1)))
        if kind in ("Q5_0", "Q5_1", "Q5_K"):
            parts.append(as_bytes(_high_planes(q, 1).reshape(groups, count, sub, -1)))
        elif kind == "Q6_K":
            parts.append(as_bytes(_high_planes(q, 2).reshape(groups, count, sub, -1)))
    packed = torch.cat(parts, dim=-1)
    assert packed.shape[-1] == FORMATS[kind].packed_bytes, (kind, packed.shape)
    return packed


def concat_packed(parts: list[torch.Tensor]) -> torch.Tensor:
    """Several `quant_pack`ed weights of one format and input size as one (their outputs one after another):
    what a fused product (q/k/v, gate/up) runs over."""
    kinds = {quant_format(p) for p in parts}
    if len(kinds) != 1 or None in kinds or len({p.shape[1] for p in parts}) != 1:
        raise ValueError("quantized weights fuse only with the same format and input size")
    return torch.cat(parts)
