"""A GGUF file run as it is stored: its Q8_0, Q4_0 and Q4_1 weights kept in their blocks, computed natively.

How: the model loads as before, dequantized to float32 through transformers (`gguf.load_gguf`), which gives its
structure, tokenizer, norms and embedding. Then every 2-d tensor of the file in a format our products compute
(`targets.quant_linear.FORMATS`) is matched to the ``nn.Linear`` whose float32 weight it dequantizes to, bit for
bit, and attached to it (`packed_linear.QUANT`, laid out by `quant_pack`); the module's dense copy is dropped
(kept where it is also the input embedding: a tied ``lm_head``). Those layers then run on integer dot products
over the file's blocks (``csrc/quant_linear.cpp``, inputs rounded to 8 bits per block of 32 as llama.cpp rounds
them), reading a quarter (Q4) to a half (Q8_0) of bfloat16's bytes. The quantized model is its own model, close to
the file dequantized to float32 (its greedy tokens mostly agree, `bench/bench_quant_sizes.py`): every method is
checked against plain decoding of it.

Matching by content, not by name: converters rename tensors per architecture and permute the rows of some
(llama's q/k projections, for its rotary layout, which transformers undoes at load). Each row's hash finds the
row order and an equality check of the whole weight proves it; a tensor that matches nothing, or is of another
type (F16, Q4_K, Q6_K, ...), stays dequantized and is named in `QuantizedWeights.describe`.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from lattice_inference.devices import WEIGHTS
from lattice_inference.targets.packed_linear import QUANT
from lattice_inference.targets.quant_linear import BLOCK, FORMATS, dequantize, quant_pack

_HASH_SEED = 0x5EED
_ATTACHED = "_lattice_quantized"


@dataclass
class QuantizedWeights:
    """What `attach` did: how many linear layers run on each quantized format, and which tensors stayed dense."""

    native: Counter[str] = field(default_factory=Counter)
    """GGUF format -> linear layers computed from its blocks."""
    dequantized: list[str] = field(default_factory=list)
    """``name (type)`` of the file's 2-d tensors left dequantized to float32."""

    def describe(self) -> str:
        """One line: ``"linear layers computed as stored: 210 Q4_1, 1 Q8_0; dequantized to float32: none"``."""
        native = ", ".join(f"{n} {kind}" for kind, n in sorted(self.native.items())) or "none"
        dense = ", ".join(self.dequantized[:6]) + (
            f" and {len(self.dequantized) - 6} more" if len(self.dequantized) > 6 else ""
        )
        return f"linear layers computed as stored: {native}; dequantized to float32: {dense or 'none'}"

    @property
    def formats(self) -> str:
        """The formats computed natively, most used first (``"Q4_1+Q8_0"``), or ``""``."""
        return "+".join(kind for kind, _ in self.native.most_common())


def _row_hashes(weight: torch.Tensor) -> torch.Tensor:
    """One int64 per row of a float32 ``weight``, equal for rows of equal values (``-0.0`` as ``0.0``)."""
    generator = torch.Generator().manual_seed(_HASH_SEED)
    mix = torch.randint(-(2**62), 2**62, (weight.shape[1],), generator=generator, dtype=torch.int64)
    parts = [
        ((chunk + 0.0).view(torch.int32).to(torch.int64) * mix).sum(dim=1)  # wraps: an integer mix, order-free
        for chunk in weight.split(4096)
    ]
    return torch.cat(parts)


def _row_order(
    found: torch.Tensor, found_hashes: torch.Tensor, weight: torch.Tensor, wanted: torch.Tensor
) -> torch.Tensor | None:
    """The row order ``perm`` with ``found[perm]`` equal to ``weight`` (whose row hashes are ``wanted``) bit for bit,
    else None."""
    if not torch.equal(found_hashes.sort().values, wanted.sort().values):
        return None
    perm = torch.empty_like(wanted)
    perm[wanted.argsort()] = found_hashes.argsort()
    return perm if torch.equal(found[perm], weight) else None


def _candidates(model: nn.Module) -> dict[tuple[int, int], list[nn.Linear]]:
    """The model's CPU float32 linear layers a quantized weight may replace, by ``(out, in)``."""
    found: dict[tuple[int, int], list[nn.Linear]] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and isinstance(weight, torch.Tensor) and weight.device.type == "cpu":
            if weight.dtype == torch.float32 and weight.dim() == 2 and weight.shape[0] % 16 == 0:
                found.setdefault((int(weight.shape[0]), int(weight.shape[1])), []).append(module)
    return found


def file_tensors(path: str | Path) -> Iterator[tuple[str, str, torch.Tensor | None]]:
    """Every 2-d tensor of the GGUF file ``path``: its name, its type (``"Q4_1"``, ``"F16"``, ...) and, where our
    products compute that type (`FORMATS`), its data (uint8 ``[out, bytes]``), else None."""
    import gguf

    for tensor in gguf.GGUFReader(str(path)).tensors:
        if len(tensor.shape) == 2:
            kind = tensor.tensor_type.name
            raw = torch.from_numpy(tensor.data.copy()).reshape(int(tensor.shape[1]), -1) if kind in FORMATS else None
            yield tensor.name, kind, raw


def _kept_dense(model: nn.Module) -> set[int]:
    """The ids of the weights whose dense copy stays: the input embedding's (its lookup) and the output layer's (MTP
    heads share it; tied, it is the embedding's)."""
    if not isinstance(model, PreTrainedModel):
        return set()
    modules = (model.get_input_embeddings(), model.get_output_embeddings())
    return {id(m.weight) for m in modules if isinstance(m, nn.Module) and isinstance(m.weight, torch.Tensor)}


def attach_tensors(model: nn.Module, tensors: Iterable[tuple[str, str, torch.Tensor | None]]) -> QuantizedWeights:
    """Give every linear layer of ``model`` whose float32 weight one of ``tensors`` (`file_tensors`) dequantizes
    to its quantized blocks (`packed_linear.QUANT`) and drop its dense copy (see the module docstring); ``model``
    must not be packed yet (`pack_linears` then runs those layers on the blocks)."""
    candidates = _candidates(model)
    kept = _kept_dense(model)
    hashes_of: dict[int, torch.Tensor] = {}  # each candidate's row hashes, computed once
    done = QuantizedWeights()
    for name, kind, raw in tensors:
        if raw is None:
            if kind != "F32":
                done.dequantized.append(f"{name} ({kind})")
            continue
        shape = (raw.shape[0], raw.shape[1] // FORMATS[kind][0] * BLOCK)
        values = dequantize(raw, kind)
        hashes = _row_hashes(values)
        for module in candidates.get(shape, []):
            weight = module.weight.detach()
            if id(module) not in hashes_of:
                hashes_of[id(module)] = _row_hashes(weight)
            perm = _row_order(values, hashes, weight, hashes_of[id(module)])
            if perm is None:
                continue
            setattr(module, QUANT, quant_pack(raw[perm], kind))
            if id(module.weight) not in kept:  # the embedding's, or the output layer's (MTP heads share it)
                module.weight = nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
            candidates[shape].remove(module)
            done.native[kind] += 1
            break
        else:
            done.dequantized.append(f"{name} ({kind}, unmatched)")
    setattr(model, _ATTACHED, done)
    if done.native:
        setattr(model, WEIGHTS, f"GGUF {done.formats}")
    return done


def attach(model: nn.Module, path: str | Path) -> QuantizedWeights:
    """`attach_tensors` over the GGUF file ``path`` (``model`` is that file dequantized to float32), saying on
    stderr which layers run as stored."""
    done = attach_tensors(model, file_tensors(path))
    print(f"lattice: {Path(path).name}: {done.describe()}", file=sys.stderr)
    return done


def quantized_weights(model: nn.Module) -> QuantizedWeights | None:
    """What `attach` did to ``model``, or None where its weights are not quantized."""
    found = getattr(model, _ATTACHED, None)
    return found if isinstance(found, QuantizedWeights) else None
