"""A GGUF file run as it is stored: its quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: every type
of a Q4_K_M, Q5_K_M, Q6_K or Q8_0 file) kept in their blocks, computed natively.

How: the model loads as before, dequantized to float32 through transformers (`gguf_dequantized.load_gguf`), which gives
its structure, tokenizer, norms and embedding. Then every 2-d tensor of the file in a format our products compute
(`kernels.quant_linear.FORMATS`) is matched to the ``nn.Linear`` whose float32 weight it dequantizes to, bit for
bit, and attached to it (`packed_linear.QUANT`, laid out by `quant_pack`); the module's dense copy is dropped
(kept where it is also the input embedding: a tied ``lm_head``). Those layers then run on integer dot products
over the file's blocks (``csrc/quant_linear.cpp``, inputs rounded to 8 bits as llama.cpp rounds them for each
format), reading a quarter (Q4) to a half (Q8_0) of bfloat16's bytes. The quantized model is its own model, close to
the file dequantized to float32 (its greedy tokens mostly agree, `bench/bench_quant_sizes.py`): every method is
checked against plain decoding of it.

Matching by content, not by name: converters rename tensors per architecture and permute the rows of some
(llama's q/k projections, for its rotary layout, which transformers undoes at load). Each row's hash finds the
row order and an equality check of the whole weight proves it; a tensor that matches nothing, or is of another
type (F16, BF16, Q2_K, Q3_K, IQ*), stays dequantized and is named in `QuantizedWeights.describe` with what it
costs (its bytes in the file against float32's).

Loading without the dequantized model (`load_as_stored`): dequantizing the whole file to float32 first holds 8 bytes
per weight at its peak (7.8-8.6 GB for a 1 GB file at SmolLM2-1.7B's shape). Where transformers' own GGUF loading
changes a tensor by at most a permutation of its rows (llama's q/k; every architecture whose tensor processor is the
identity, llama's or Gemma's, which only shifts its norms), the model is built with its parameters on the meta device,
each file tensor is named as transformers names it (`get_gguf_hf_weights_map`), a quantized one is attached to its
linear layer with that row order applied to its blocks (the permutation found by running transformers' processor over
the row indices), and only the rest (norms, types without a kernel) is dequantized, one tensor at a time. The input
embedding stays in its blocks too (`QuantizedEmbedding`: a lookup dequantizes just its rows, the values the dense
embedding holds), and a tied output layer computes from those blocks, so no dense copy of the vocabulary is made at all;
an untied output layer keeps only its blocks too (a file of the 0.5B Qwen2 shape: 0.5 GB of float32 not made). Both ways
attach the same blocks in the same order and give the same dense tensors and the same logits (tested); elsewhere the
first way runs. What the load frees (each tensor's transients) goes back to the system as it goes
(`release_freed_memory`).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lattice_inference.devices import WEIGHTS
from lattice_inference.errors import ModelLoadError
from lattice_inference.kernels.packed_linear import QUANT, pack_linears
from lattice_inference.kernels.quant_linear import FORMATS, columns, dequantize, quant_pack
from lattice_inference.models.gguf_index import GGUFIndex, StoredTensor, read_index
from lattice_inference.process import release_freed_memory

_HASH_SEED = 0x5EED
_ATTACHED = "_lattice_quantized"


@dataclass
class QuantizedWeights:
    """What `attach` did: how many linear layers run on each quantized format, and which tensors stayed dense."""

    native: Counter[str] = field(default_factory=Counter)
    """GGUF format -> linear layers computed from its blocks."""
    dequantized: list[str] = field(default_factory=list)
    """``name (type)`` of the file's 2-d tensors left dequantized to float32."""
    dequantized_bytes: int = 0
    """What those take as float32, against their blocks' bytes in the file: the cost of a type without a kernel."""
    stored_bytes: int = 0

    def describe(self) -> str:
        """One line: ``"linear layers computed as stored: 210 Q4_1, 1 Q8_0; dequantized to float32: none"`` (with
        what the dequantized tensors cost where any: ``"... (3.2 MiB in the file, 12.0 MiB as float32)"``)."""
        native = ", ".join(f"{n} {kind}" for kind, n in sorted(self.native.items())) or "none"
        dense = ", ".join(self.dequantized[:6]) + (
            f" and {len(self.dequantized) - 6} more" if len(self.dequantized) > 6 else ""
        )
        cost = ""
        if self.dequantized_bytes:
            mib = 1 << 20
            cost = (
                f" ({self.stored_bytes / mib:.1f} MiB in the file, {self.dequantized_bytes / mib:.1f} MiB as float32)"
            )
        return f"linear layers computed as stored: {native}; dequantized to float32: {dense or 'none'}{cost}"

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
    for tensor in read_index(path).tensors:
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
    to its quantized blocks (`packed_linear.QUANT`) and drop its dense copy (see the module docstring), routing
    those layers through their blocks (`pack_linears` with ``quantized_only``); ``model`` must not be packed yet."""
    candidates = _candidates(model)
    kept = _kept_dense(model)
    hashes_of: dict[int, torch.Tensor] = {}  # each candidate's row hashes, computed once
    done = QuantizedWeights()
    for name, kind, raw in tensors:
        if raw is None:
            if kind != "F32":
                done.dequantized.append(f"{name} ({kind})")
            continue
        shape = (raw.shape[0], columns(raw.shape[1], kind))
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
    _mark(model, done)
    return done


def _count_costs(done: QuantizedWeights, index: GGUFIndex) -> None:
    """Add up what the tensors ``done`` left dequantized take in the file and as float32."""
    names = {entry.split(" (", 1)[0] for entry in done.dequantized}
    for tensor in index.tensors:
        if tensor.name in names:
            done.stored_bytes += int(tensor.n_bytes)
            elements = 1
            for n in tensor.shape:
                elements *= int(n)
            done.dequantized_bytes += 4 * elements


def _mark(model: nn.Module, done: QuantizedWeights) -> None:
    """Finish a load: route every layer holding blocks through them (``pack_linears(quantized_only=True)``: its dense
    weight is gone, so it computes from nothing else and the loaded model runs as it is), and record on ``model`` what
    was attached (`quantized_weights`) and, where any layer runs as stored, the weights `devices.placement` reports."""
    pack_linears(model, quantized_only=True)
    setattr(model, _ATTACHED, done)
    if done.native:
        setattr(model, WEIGHTS, f"GGUF {done.formats}")


def _announce(path: str | Path, done: QuantizedWeights) -> None:
    """Say on stderr which layers of the file ``path`` run as stored."""
    print(f"lattice: {Path(path).name}: {done.describe()}", file=sys.stderr)


def attach(model: nn.Module, path: str | Path) -> QuantizedWeights:
    """`attach_tensors` over the GGUF file ``path`` (``model`` is that file dequantized to float32), saying on
    stderr which layers run as stored."""
    done = attach_tensors(model, file_tensors(path))
    _count_costs(done, read_index(path))
    _announce(path, done)
    return done


def quantized_weights(model: nn.Module) -> QuantizedWeights | None:
    """What `attach` did to ``model``, or None where its weights are not quantized."""
    found = getattr(model, _ATTACHED, None)
    return found if isinstance(found, QuantizedWeights) else None


def _skeleton(
    path: Path,
) -> tuple[GGUFIndex, PreTrainedModel, PreTrainedTokenizerBase, Any, dict[str, str]] | None:
    """`load_as_stored`'s start: the file's index, an empty model of its config (on the meta device), its tokenizer,
    transformers' tensor processor for its architecture and the file's tensor names to the model's; None where the
    processor reshapes tensors beyond a row permutation or the config cannot be read (the dequantizing load then
    names what is wrong)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        Gemma2TensorProcessor,
        LlamaTensorProcessor,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    from lattice_inference.models.gguf_dequantized import check_gguf_file, config_and_tokenizer, load_error

    check_gguf_file(path)
    try:
        reader = read_index(path)
    except Exception as exc:  # gguf raises many types for a bad file
        raise load_error(path, exc) from exc
    try:
        config, tokenizer = config_and_tokenizer(path)
    except ModelLoadError:
        return None  # the dequantizing load names what is wrong with the file, as it always has
    processor = TENSOR_PROCESSORS.get(reader.architecture, TensorProcessor)(config=config.to_dict())
    if type(processor) not in (TensorProcessor, LlamaTensorProcessor, Gemma2TensorProcessor):  # rows permuted at most
        return None
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    names = _tensor_names(model, reader.architecture) or get_gguf_hf_weights_map(model, processor)
    return reader, model, tokenizer, processor, names


def _tied_and_complete(
    model: PreTrainedModel,
    inputs: nn.Module | None,
    outputs: nn.Module | None,
    tied: tuple[str, torch.Tensor, bool] | None,
    linears: dict[str, nn.Linear],
    done: QuantizedWeights,
) -> bool:
    """`load_as_stored`'s end: a tied output layer given the embedding's blocks (``tied``: kind, blocks, packed?),
    or tied as transformers ties it; whether every parameter is now held (none left on the meta device)."""
    if model.config.tie_word_embeddings:
        if not isinstance(inputs, QuantizedEmbedding):
            model.tie_weights()
        if isinstance(outputs, nn.Linear) and tied is not None and getattr(outputs, QUANT, None) is None:
            kind, blocks, is_packed = tied
            setattr(outputs, QUANT, blocks if is_packed else quant_pack(blocks, kind))  # one copy where packed
            done.native[kind] += 1
    quantized = {id(m.weight) for m in linears.values() if getattr(m, QUANT, None) is not None}
    return not any(p.device.type == "meta" and id(p) not in quantized for p in model.parameters())


def load_as_stored(path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase] | None:
    """The GGUF file ``path`` as a model whose quantized linear layers hold the file's blocks, built without
    dequantizing the file whole (see the module docstring), and its tokenizer (what was attached: `quantized_weights`
    of the model); None where transformers reshapes this architecture's tensors beyond a row permutation, or a
    parameter is not in the file (then load it dequantized and `attach`)."""
    import gguf
    import numpy as np

    from lattice_inference.kernels import native_ops

    skeleton = _skeleton(path := Path(path))
    if skeleton is None:
        return None
    reader, model, tokenizer, processor, names = skeleton
    linears = {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    done = QuantizedWeights()
    tied: tuple[str, torch.Tensor, bool] | None = None  # the embedding's kind and blocks (packed?), for a tied output
    reads_packed = native_ops.ops()  # reads an embedding's rows back from packed blocks (``quant_rows``), where built
    for tensor in reader.tensors:
        release_freed_memory()  # the last tensor's buffers, before this one's
        kind, rows = tensor.tensor_type.name, int(tensor.shape[-1])
        native = kind in FORMATS and len(tensor.shape) == 2
        if native:  # the row order transformers gives this tensor, from its processor run over the row indices
            result = processor.process(weights=np.arange(rows, dtype=np.int64).reshape(rows, 1), name=tensor.name,
                                       tensor_key_mapping=names, parsed_parameters={})  # fmt: skip
            perm = torch.from_numpy(np.ascontiguousarray(result.weights).reshape(-1))
        else:
            try:
                values = gguf.dequantize(tensor.data, tensor.tensor_type)
            except NotImplementedError:
                return None  # a type gguf cannot dequantize: the dequantizing load names it
            result = processor.process(weights=values, name=tensor.name, tensor_key_mapping=names, parsed_parameters={})
        hf_name = names.get(result.name)
        if hf_name is None:
            continue  # as transformers skips it
        target = model.get_parameter(hf_name)
        if native:
            shape = (rows, columns(int(tensor.n_bytes) // rows, kind))
            if tuple(target.shape) != shape:
                return None
            is_embedding = inputs is not None and target is inputs.weight
            packs_rows = reads_packed is not None and rows % 16 == 0  # an embedding read from the packed layout
            if hf_name in linears or (is_embedding and packs_rows):
                packed = _packed_from_file(reader, tensor, perm, kind)
                if hf_name in linears:
                    setattr(linears[hf_name], QUANT, packed)
                    done.native[kind] += 1
                    continue  # no dense copy (`dense_embeddings` names an untied output layer held only as blocks)
            else:
                raw = torch.from_numpy(np.asarray(tensor.data).reshape(rows, -1)[perm.numpy()])  # one copy, ordered
                _release(reader, tensor)
            if is_embedding:
                scale = getattr(inputs, "embed_scale", None)  # Gemma's embeddings scale their rows
                if packs_rows:  # rows read back from the packed layout (a tied output layer's too)
                    tied = (kind, packed, True)
                    embedding = QuantizedEmbedding(packed, kind, scale, dim=shape[1], native=reads_packed)
                else:  # looked up row by row from the file's blocks, no dense copy
                    tied = (kind, raw, False)
                    embedding = QuantizedEmbedding(raw, kind, scale)
                model.set_input_embeddings(embedding)
                inputs = embedding
                continue
            dense = dequantize(raw, kind)
        else:
            if kind != "F32" and len(tensor.shape) == 2:
                done.dequantized.append(f"{tensor.name} ({kind})")
            dense = torch.from_numpy(np.array(result.weights, dtype=np.float32))  # a copy: F32 comes as a view
            _release(reader, tensor)
            if dense.numel() != target.numel():
                return None
            dense = dense.reshape(target.shape)
        _set_parameter(model, hf_name, dense)
    if not _tied_and_complete(model, inputs, outputs, tied, linears, done):
        return None  # a parameter the file does not hold
    release_freed_memory()
    _count_costs(done, reader)
    _mark(model, done)
    _announce(path, done)
    return model.eval(), tokenizer


class QuantizedEmbedding(nn.Module):
    """An input embedding kept in the GGUF file's blocks (uint8 ``[vocab, bytes]``, as stored): a lookup
    dequantizes only the rows it returns, each bit for bit the row the whole tensor dequantized holds
    (`quant_linear.dequantize` works row by row), so the model computes what it computes over the dense embedding,
    without its float32 copy (0.4 GB at SmolLM2-1.7B's shape, for a 56 MB Q4_0 tensor).

    ``weight`` (not a parameter) is a placeholder on the meta device (the dense shape and dtype, no data), as for
    the linear layers whose dense weights were dropped: code that reads the shape works, code that would read values
    fails at once; `dense_embeddings` gives the values where they are needed (an MTP head's lookup)."""

    def __init__(
        self,
        blocks: torch.Tensor,
        kind: str,
        scale: torch.Tensor | None = None,
        *,
        dim: int | None = None,
        native: ModuleType | None = None,
    ) -> None:
        """``blocks``: the file's (uint8 ``[vocab, bytes]``); or, with ``native`` (the native ops) and ``dim`` (the
        row width), `quant_pack`'s layout of them, from which ``quant_rows`` reads a row back bit for bit: a tied
        output layer computes on the same blocks, so the vocabulary is held once (170 MiB less for Gemma-3-270M)."""
        super().__init__()
        self.kind = kind
        self.scale = scale
        """The factor every row is multiplied by (Gemma's ``embed_scale``), or None."""
        if (native is None) != (dim is None):
            raise ValueError("packed embedding blocks need both the native ops and the row width")
        self.register_buffer("blocks", blocks, persistent=False)
        vocab = blocks.shape[0] * 16 if native is not None else blocks.shape[0]
        # a plain attribute, not a parameter: the model's parameters (whose first one tells its device) stay real
        self.weight = torch.empty(vocab, dim if dim is not None else columns(blocks.shape[1], kind), device="meta")
        self._dense: torch.Tensor | None = None  # `dense`, once made
        self._native = native

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows ``ids`` (int64 ``[n]``) of the blocks, float32 ``[n, dim]``."""
        blocks = cast(torch.Tensor, self.blocks)
        if self._native is not None:
            return self._native.quant_rows(blocks, ids.to(torch.long).cpu().contiguous(), self.kind)
        return dequantize(blocks[ids.to(blocks.device)], self.kind)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows of ``ids`` (any shape), ``[*ids.shape, dim]``."""
        rows = self._rows(ids.reshape(-1))
        if self.scale is not None:  # as the model's own embedding: the rows times its scale in their dtype
            rows = rows * self.scale.to(rows.dtype)
        return rows.reshape(*ids.shape, rows.shape[-1]).to(ids.device)

    def dense(self) -> torch.Tensor:
        """The whole embedding dequantized (float32 ``[vocab, dim]``, the full size), made on the first call and kept:
        every MTP head of the model (one per draft length in a server) shares the one copy."""
        if self._dense is None:
            self._dense = self._rows(torch.arange(self.weight.shape[0]))
        return self._dense


def dense_embeddings(model: PreTrainedModel) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense input embedding and output layer weights of ``model`` (what an MTP head shares with its trunk),
    dequantized from the blocks where the model holds only those (`QuantizedEmbedding`, and a tied output layer)."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    embed = inputs.dense() if isinstance(inputs, QuantizedEmbedding) else inputs.weight
    assert isinstance(outputs, nn.Module) and isinstance(embed, torch.Tensor)
    head = outputs.weight
    assert isinstance(head, torch.Tensor)
    if head.device.type == "meta":
        if not model.config.tie_word_embeddings:
            raise ModelLoadError("the output layer holds only its quantized blocks: no dense copy to share")
        head = embed
    return embed, head


def _set_parameter(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace the (meta) parameter ``name`` of ``model`` with ``value``."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    setattr(module, leaf, nn.Parameter(value, requires_grad=False))


def _tensor_names(model: nn.Module, architecture: str) -> dict[str, str] | None:
    """GGUF tensor name -> parameter name of ``model``, as `get_gguf_hf_weights_map` maps them where every
    parameter has a name in gguf-py's map for ``architecture`` (else None): one name map built, where that function
    builds one per module (seconds for a small model)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if arch is None or not isinstance(layers, int):
        return None
    name_map = get_tensor_name_map(arch, layers)
    names = {}
    for hf_name in model.state_dict():
        name, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(name) if suffix in ("weight", "bias") else None
        if gguf_name is None:
            return None
        names[f"{gguf_name}.{suffix}"] = hf_name
    return names


def _release(reader: GGUFIndex, tensor: StoredTensor, rows: tuple[int, int] | None = None) -> None:
    """Drop the pages of ``tensor`` (or of its stored ``rows`` ``[first, end)``), read already, from this process's
    mapping of the file: they stay in the page cache (a later read maps them again), but no longer count towards
    the memory the load holds at once (a whole file's worth, else)."""
    import mmap

    mapped = getattr(reader.data, "_mmap", None)
    if not isinstance(mapped, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    first, end = 0, int(tensor.n_bytes)
    if rows is not None:
        row_bytes = int(tensor.n_bytes) // int(tensor.shape[-1])
        first, end = rows[0] * row_bytes, rows[1] * row_bytes
    start = (tensor.data_offset + first) // mmap.PAGESIZE * mmap.PAGESIZE
    mapped.madvise(mmap.MADV_DONTNEED, start, tensor.data_offset + end - start)


_PACK_ROWS = 4096  # rows packed at a time (a multiple of 16): a slice's copy, not the tensor's, is held beside


def _packed_from_file(reader: GGUFIndex, tensor: StoredTensor, perm: torch.Tensor, kind: str) -> torch.Tensor:
    """`quant_pack` of the stored ``tensor``'s rows in the order ``perm``, slice by slice of rows into the one
    result, each slice's file pages dropped once read (`_release`): the load holds the packed tensor and one
    slice, where a whole copy first would hold the largest tensor twice (Gemma-3-270M's 170 MiB vocabulary)."""
    import numpy as np

    rows = int(tensor.shape[-1])
    stored = np.asarray(tensor.data).reshape(rows, -1)
    order = perm.numpy()
    out: torch.Tensor | None = None
    for start in range(0, rows, _PACK_ROWS):
        picked = order[start : start + _PACK_ROWS]
        part = quant_pack(torch.from_numpy(stored[picked]), kind)
        if out is None:
            out = torch.empty((rows // 16, *part.shape[1:]), dtype=part.dtype)
        out[start // 16 : start // 16 + part.shape[0]] = part
        _release(reader, tensor, (int(picked.min()), int(picked.max()) + 1))
    assert out is not None
    return out
