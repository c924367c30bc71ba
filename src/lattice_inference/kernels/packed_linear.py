"""Linear layers over oneDNN-packed weights: the same matmuls, laid out for the CPU's kernels.

A decode step of a small model on a CPU is a few hundred matrix-vector products, and PyTorch's default
``F.linear`` (MKL ``sgemm``/``sgemv`` over the row-major weight) reads the weights well below the memory
bandwidth, and a 2..8-row product (a speculative verification) costs much more than a 1-row one. oneDNN's linear
over a weight reordered once into its blocked layout (what ``torch.compile`` with freezing uses on CPUs) is faster
at every width measured, the decode step and verifications alike (``bench/profile_step.py``; figures in
bench/RESULTS.md).

In bfloat16 on CPUs with AMX (and the native ops built: `native_ops.tiles`) the weights are laid out for our own
tile products instead (``csrc/tile_linear.cpp``): every row in a zero-padded 16-row tile, so a product of 1 to 16
rows costs about one read of the weights and each row comes out the same at any width; a step of SmolLM2-135M
spends ~11 ms on them against ~14.5 ms on oneDNN's (bench/RESULTS.md, session 12).

In float32 on CPUs with AVX512F or AVX2 and FMA (the native ops built: `native_ops.rows`) the weights are laid out
for our row products (``csrc/rows_linear.cpp``): each output of each row one float32 sum over the inputs in order,
so each row comes out the same at any width (a float32 prefill's rows are then reusable, `prefix_reuse`), and a
1-token step of SmolLM2-135M spends 1.4-1.6x less than on oneDNN's on a Zen 4 EPYC (bench/RESULTS.md, session 21).
bfloat16 weights where no bfloat16 dot-product kernel runs (AVX2-only CPUs, AVX512F without BF16) take the same row
products from their bfloat16 bytes (float32 sums, rounded once to bfloat16): half float32's weight reads, none of
torch's emulated bfloat16, and rows alike at any width (``bench/bench_bf16_rows.py``).

Projections that read the same input are packed as one matrix: ``q_proj``/``k_proj``/``v_proj`` of an
attention block and ``gate_proj``/``up_proj`` of a gated MLP (one product instead of three or two: fewer
passes over the input, fewer thread hand-offs). The model's code still calls each projection; the first call
computes the fused product and the others return their slice of it when called with that same input tensor
(anything else runs their own part of the weight).

GGUF weights kept quantized (`quant_linear.FORMATS`; `models.gguf_quantized` leaves each module's blocks
under `QUANT`) run on our quantized products (``csrc/quant_linear.cpp``, `quant_linear`): float32 rows in and out,
integer dot products over the file's blocks, each row the same at any width. Siblings stored in different formats
(a Q4_K_M file's q/k in Q4_K and v in Q6_K) still make one product: their blocks side by side (`Packed` as a list),
the inputs quantized once per kind of activation.

`pack_linears` keeps a packed copy of every ``nn.Linear`` weight (so the linear weights take twice their memory;
the dense ones stay, for the embedding tie, ``state_dict`` and MTP heads) and routes the module's ``forward``
through it; `unpack_linears` undoes it. A target packs its own view of the model (`model_view.runner_view`), never
the caller's modules; the packings are kept by weight tensor (`_shared_packing`), so every view of one model shares
one packed copy of each weight. Layers that hold GGUF blocks compute from nothing else (their dense weight is gone),
so the loader routes them as it attaches the blocks (``pack_linears(model, quantized_only=True)``): a model loaded
from a GGUF file runs as loaded, and the views of it keep that routing, one copy of the blocks.

Only CPU modules whose weight a kernel here takes are touched (`packable`: ours, float32 and bfloat16 with out a
multiple of 16, or oneDNN's: float32 everywhere, bfloat16 only with AVX512-BF16/AMX-class support). The results
equal ``F.linear``'s up to float rounding (a different summation order), as any other kernel choice would. Inside a
decode-matched forward each product runs under its row plan (`lattice_inference.kernels.decode_matched`), so that
its rows do not depend on how many there are.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from lattice_inference.kernels import native_ops
from lattice_inference.kernels.decode_matched import (
    PRODUCT,
    Product,
    linear_key,
    matched_product,
    module_product,
    plain_linear,
)
from lattice_inference.kernels.quant_linear import FORMATS, concat_packed, quant_format
from lattice_inference.process import release_freed_memory

_PACKED = "_lattice_packed_weight"
QUANT = "_lattice_quant_weight"
"""Attribute of an ``nn.Linear`` holding its GGUF-quantized weight in `quant_linear.quant_pack`'s layout (set by
`models.gguf_quantized`): `pack_linears` runs the module over it; the dense weight may be gone (meta)."""

FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling projections (attribute names of one module) that read the same input, packed as one matrix."""


@functools.cache
def packing_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack a linear weight of ``dtype`` on this CPU (checked once per dtype)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _tiles_for(weight: torch.Tensor) -> ModuleType | None:
    """The native AMX products (`native_ops.tiles`) where they take ``weight``: bfloat16, ``[out, in]`` with out a
    multiple of 16 and in of 32; else None (oneDNN packs it)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[0] % 16 or weight.shape[1] % 32:
        return None
    return native_ops.tiles()


def _rows_for(weight: torch.Tensor) -> ModuleType | None:
    """The native row products (`native_ops.rows`) where they take ``weight``: ``[out, in]`` with out a multiple of
    16, float32, or bfloat16 where no bfloat16 dot-product kernel runs (AVX2-only CPUs, AVX512F without BF16:
    computed in float32 from the bfloat16 bytes); else None (oneDNN packs it)."""
    if weight.dim() != 2 or weight.shape[0] % 16:
        return None
    takes = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and native_ops.tiles() is None)
    return native_ops.rows() if takes else None


def packable(weight: torch.Tensor) -> bool:
    """Whether `pack_weight` lays ``weight`` out for a kernel that runs here: ours (`_tiles_for`, `_rows_for`) or
    oneDNN's (`packing_supported`); only CPU weights."""
    if weight.device.type not in ("cpu", "meta"):
        return False
    return _tiles_for(weight) is not None or _rows_for(weight) is not None or packing_supported(weight.dtype)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A packed copy of a dense ``[out, in]`` weight (check `packing_supported` first), for `packed_linear`: laid
    out for our products where they run (bfloat16 on CPUs with AMX or AVX512-BF16, ``csrc/tile_linear.cpp``;
    float32 on CPUs with AVX512F or AVX2, ``csrc/rows_linear.cpp``: each row computed alike at any width), else for
    oneDNN."""
    with torch.no_grad():
        tiles = _tiles_for(weight)
        if tiles is not None:
            return tiles.tile_pack(weight.detach())
        rows = _rows_for(weight)
        if rows is not None:
            return rows.rows_pack(weight.detach())
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def tile_packed(packed: torch.Tensor) -> bool:
    """Whether ``packed`` (from `pack_weight`) is laid out for the bfloat16 tile products."""
    return packed.dim() == 4 and packed.shape[2:] == (16, 2)


def rows_packed(packed: torch.Tensor) -> bool:
    """Whether ``packed`` (from `pack_weight`) is laid out for the row products (float32 or bfloat16)."""
    return packed.dim() == 3 and packed.shape[2] == 16 and packed.dtype in (torch.float32, torch.bfloat16)


Packed = torch.Tensor | list[torch.Tensor]
"""A packed weight: one matrix, or (quantized members of a fused group in several formats) its parts side by side."""


_PACKINGS = WeakIdKeyDictionary()
"""Packings of dense weights made so far, by the first weight they pack (then by the ids of the rest: siblings fused):
kept as long as that weight lives, whichever view of its model (`model_view.runner_view`) packed it first. (Quantized
blocks are routed once, by the loader, and every view shares that routing.)"""
_PACKINGS_LOCK = threading.Lock()


def _shared_packing(weights: Sequence[torch.Tensor], make: Callable[[], Packed]) -> Packed:
    """The packing of ``weights`` (one matrix, or siblings fused as one), made by ``make`` once per set of weight
    tensors: targets over one model, each packing its own view, share it."""
    with _PACKINGS_LOCK:
        made: dict[tuple[int, ...], Packed] = _PACKINGS.setdefault(weights[0], {})
        key = tuple(id(w) for w in weights[1:])
        packed = made.get(key)
        if packed is None:
            packed = made[key] = make()
        return packed


def _parts(packed: Packed) -> list[torch.Tensor]:
    return packed if isinstance(packed, list) else [packed]


def quant_packed(packed: Packed) -> bool:
    """Whether ``packed`` is a GGUF-quantized weight laid out for the quantized products (`QUANT`), or parts of such
    weights side by side."""
    return all(quant_format(p) is not None for p in _parts(packed))


def quant_inputs(packed: torch.Tensor) -> int:
    """The inputs a `quant_pack`ed weight takes."""
    fmt = quant_format(packed)
    assert fmt is not None
    return int(packed.shape[1]) * FORMATS[fmt].inputs


def compute_dtype(packed: Packed) -> torch.dtype:
    """The dtype of the inputs and outputs of products over ``packed``: float32 for quantized weights, else the
    packed weight's own."""
    return torch.float32 if quant_packed(packed) else _parts(packed)[0].dtype


def packed_kind(packed: Packed) -> str:
    """The plan-key kind (`decode_matched.linear_key`) of products over ``packed``: ``"tiles"``, ``"rows"`` or
    ``"quant-<format>"`` for our kernels, ``"packed"`` for oneDNN's. They round differently, so each is calibrated
    on its own."""
    if quant_packed(packed):
        return "quant-" + "+".join(str(quant_format(p)) for p in _parts(packed))
    assert isinstance(packed, torch.Tensor)
    return "tiles" if tile_packed(packed) else "rows" if rows_packed(packed) else "packed"


def packed_linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` over ``packed = pack_weight(weight)`` (``x`` on the CPU, in its dtype); over
    quantized parts, their outputs side by side."""
    if isinstance(packed, list) and len(packed) > 1:
        module = native_ops.ops()
        assert module is not None
        return module.quant_linear_parts(x, packed, bias)
    packed = _parts(packed)[0]
    if tile_packed(packed) or rows_packed(packed) or quant_packed(packed):  # only where ours run: no check per call
        module = native_ops.ops()
        assert module is not None
        if quant_packed(packed):
            return module.quant_linear(x, packed, bias)
        return module.tile_linear(x, packed, bias) if tile_packed(packed) else module.rows_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _off_packed(x: torch.Tensor, packed: Packed) -> bool:
    """Whether ``x`` must bypass the packed weight (another dtype or device); an error where there is no dense
    weight to fall back on (quantized weights)."""
    if x.dtype == compute_dtype(packed) and x.device.type == "cpu":
        return False
    if quant_packed(packed):
        raise ValueError(f"quantized weights compute float32 inputs on the CPU, got {x.dtype} on {x.device}")
    return True


def _packed_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    packed = getattr(module, _PACKED)
    if _off_packed(x, packed):
        return nn.functional.linear(x, module.weight, module.bias)
    key, kernel, _ = getattr(module, PRODUCT)
    return matched_product(key, kernel, x)


class _FusedGroup:
    """One packed matrix for sibling projections; remembers the last input and its split output."""

    def __init__(self, members: list[nn.Linear]) -> None:
        self.members = members
        self.splits = [m.out_features for m in members]
        with torch.no_grad():
            quants = [getattr(m, QUANT, None) for m in members]
            self.packed: Packed
            held = [q for q in quants if q is not None]
            if len(held) == len(quants) and len({quant_format(q) for q in held}) > 1:
                self.packed = held  # several formats: the parts side by side, the inputs quantized once per kind
            elif len(held) == len(quants):
                fused = concat_packed(held)  # once, as the file loads (`lattice_inference.models.gguf_quantized`)
                self.packed = fused
                # each member's blocks become its slice of the fused matrix: one copy of the weights, not two
                sizes = [q.shape[0] for q in held]
                for member, part in zip(members, fused.split(sizes), strict=True):
                    setattr(member, QUANT, part)
            else:
                weights = [m.weight for m in members]
                self.packed = _shared_packing(weights, lambda: pack_weight(torch.cat([w.detach() for w in weights])))
            biases = [m.bias for m in members]
            self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.kernel = functools.partial(packed_linear, packed=self.packed, bias=self.bias)
        self.key = (packed_kind(self.packed), (sum(self.splits), members[0].in_features), self.bias is not None)
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._pending: set[int] = set()

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s output for input ``x``: a slice of the fused product of ``x``."""
        if x is not self._input or index not in self._pending:
            if _off_packed(x, self.packed):
                member = self.members[index]
                return nn.functional.linear(x, member.weight, member.bias)
            y = matched_product(self.key, self.kernel, x)
            self._input, self._outputs = x, y.split(self.splits, dim=-1)
            self._pending = set(range(len(self.members)))
        self._pending.discard(index)
        out = self._outputs[index]
        if not self._pending:  # every member has its slice: let go of the input and the product
            self._input, self._outputs = None, ()
        return out


def products(members: Sequence[nn.Linear]) -> list[Product]:
    """The products that compute ``members`` (sibling projections of one input): one, split, where `pack_linears`
    packed them as a group; else each member's own (`module_product`). Running them through
    `decode_matched.matched_product` gives what calling each member gives, bit for bit."""
    group = getattr(members[0], _PACKED, None)
    # by the group each member routes to: a view's members (`model_view.runner_view`) share the loaded model's group
    if isinstance(group, _FusedGroup) and [getattr(m, _PACKED, None) for m in members] == [group] * len(group.members):
        return [(group.key, group.kernel, group.splits)]
    return [module_product(m) for m in members]


def packed_operands(product: Product) -> tuple[list[torch.Tensor], torch.Tensor | None] | None:
    """The packed weight (its parts: one matrix, maybe fused, or quantized parts side by side) and bias a `Product`
    runs `packed_linear` over, else None: what a caller outside Python (the native layer loop) needs to make the
    same call."""
    _, kernel, _ = product
    if isinstance(kernel, functools.partial) and kernel.func is packed_linear:
        return _parts(kernel.keywords["packed"]), kernel.keywords["bias"]
    return None


def _fusable(members: list[object]) -> bool:
    if not all(plain_linear(m) and not hasattr(m, _PACKED) for m in members):  # type: ignore[arg-type]
        return False
    linears = [m for m in members if isinstance(m, nn.Linear)]
    first = linears[0]
    quants = [getattr(m, QUANT, None) for m in linears]
    if any(q is not None for q in quants):  # quantized: all of one input size (their formats may differ)
        sizes = {None if q is None else quant_inputs(q) for q in quants}
        return len(sizes) == 1 and None not in sizes and len({m.bias is None for m in linears}) == 1
    fused = torch.empty(
        sum(m.out_features for m in linears), first.in_features, dtype=first.weight.dtype, device="meta"
    )
    return (
        first.weight.device.type == "cpu"
        and packable(fused)  # the fused matrix's shape decides which kernel takes it
        and all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype for m in linears)
        and len({m.bias is None for m in linears}) == 1
    )


def _pack_groups(model: nn.Module, quantized_only: bool) -> None:
    for module in model.modules():
        for names in FUSED_GROUPS:
            members = [getattr(module, name, None) for name in names]
            if not _fusable(members) or (quantized_only and not all(hasattr(m, QUANT) for m in members)):
                continue
            group = _FusedGroup(members)  # type: ignore[arg-type]
            for index, member in enumerate(group.members):
                setattr(member, _PACKED, group)
                member.forward = functools.partial(group.output, index)  # type: ignore[method-assign]
            release_freed_memory()  # quantized members' own blocks (now views of the fused matrix) were just freed


def pack_linears(model: nn.Module, *, quantized_only: bool = False) -> int:
    """Route every packable ``nn.Linear`` of ``model`` through a packed copy of its weight (``quantized_only``: only
    those holding GGUF blocks, `QUANT`, which compute from nothing else).

    Returns how many modules are packed now (idempotent: packing twice packs once). See the module docstring.
    """
    _pack_groups(model, quantized_only)
    count = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear) or (quantized_only and not hasattr(module, QUANT)):
            continue
        if not plain_linear(module):  # a subclass with its own forward (a router): left as it is
            continue
        if hasattr(module, _PACKED):
            count += 1
            continue
        weight = module.weight
        packed = getattr(module, QUANT, None)
        if packed is None:
            if not packable(weight):
                continue
            packed = _shared_packing([weight], functools.partial(pack_weight, weight))
        setattr(module, _PACKED, packed)
        kernel = functools.partial(packed_linear, packed=packed, bias=module.bias)
        setattr(module, PRODUCT, (linear_key(packed_kind(packed), weight, module.bias), kernel, [module.out_features]))
        module.forward = functools.partial(_packed_forward, module)  # type: ignore[method-assign]
        count += 1
    return count


def unpack_linears(model: nn.Module) -> None:
    """Undo `pack_linears`: every module runs ``F.linear`` over its dense weight again (and a later `pack_linears`
    of its weights packs them anew)."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            with _PACKINGS_LOCK:
                _PACKINGS.pop(weight, None)
        if hasattr(module, _PACKED):
            delattr(module, _PACKED)
            if hasattr(module, PRODUCT):
                delattr(module, PRODUCT)
            del module.forward
