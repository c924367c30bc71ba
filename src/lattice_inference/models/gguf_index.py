"""A GGUF file's tensors and architecture, read from its header without building its metadata values.

Why: gguf-py's ``GGUFReader`` turns every metadata value into numpy views as it opens a file, the tokenizer's
vocabulary and merges included (about 100,000 strings for SmolLM2's): 2.0 s of a 1.7B file's load as stored on a
2-core EPYC, for a model that needs the tensors and one string. `read_index` walks the same header (GGUF versions 2
and 3, little-endian), skipping every value but ``general.architecture`` and ``general.alignment``, and gives each
tensor as ``GGUFReader`` does (`StoredTensor`: the same name, type, shape, byte count, offset and numpy view of the
data, over one read-only mapping of the file). A file it does not read this way (another byte order or version, a
header cut short) gets ``GGUFReader`` instead, whose errors name the problem.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

__all__ = ["GGUFIndex", "StoredTensor", "read_index"]

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
"""GGUF value type -> struct format (little-endian), for the fixed-size types."""
_STRING, _ARRAY = 8, 9
_DENSE = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64}  # fmt: skip
"""Types whose data ``GGUFReader`` gives as elements; every other type comes as bytes, a row's blocks per row."""


@dataclass
class StoredTensor:
    """One tensor of the file, as ``gguf.ReaderTensor`` describes it."""

    name: str
    tensor_type: Any
    """``gguf.GGMLQuantizationType``."""
    shape: tuple[int, ...]
    """GGUF's order: the innermost (fastest-varying) size first."""
    n_bytes: int
    data_offset: int
    data: np.ndarray
    """A read-only view of the file: elements (numpy's order, the reverse of `shape`) or, for block types, bytes."""


@dataclass
class GGUFIndex:
    """What `read_index` read: the architecture, the tensors in file order, and the mapping their data views."""

    architecture: str
    tensors: list[StoredTensor]
    data: np.memmap


class _Header:
    """A cursor over the file's bytes, reading little-endian values."""

    def __init__(self, data: np.memmap) -> None:
        self.buffer, self.at = memoryview(cast(Any, data)), 0

    def read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.at)
        self.at += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        size = self.read("Q")
        text = bytes(self.buffer[self.at : self.at + size]).decode("utf-8")
        self.at += size
        return text

    def skip(self, kind: int) -> None:
        """Step over one value of GGUF type ``kind``."""
        if kind in _SCALARS:
            self.at += struct.calcsize("<" + _SCALARS[kind])
        elif kind == _STRING:
            size = self.read("Q")  # its length, then that many bytes
            self.at += size
        elif kind == _ARRAY:
            item, count = self.read("I"), self.read("Q")
            if item in _SCALARS:
                step = count * struct.calcsize("<" + _SCALARS[item])
                self.at += step
            else:
                for _ in range(count):
                    self.skip(item)
        else:
            raise ValueError(f"unknown GGUF value type {kind}")


def _parse(path: Path) -> GGUFIndex:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    data = np.memmap(path, mode="r")
    head = _Header(data)
    if bytes(head.buffer[:4]) != b"GGUF":
        raise ValueError("not a GGUF file")
    head.at = 4
    version = head.read("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}")
    tensor_count, kv_count = head.read("Q"), head.read("Q")
    architecture, alignment = "", 32
    for _ in range(kv_count):
        key, kind = head.string(), head.read("I")
        if key == "general.architecture" and kind == _STRING:
            architecture = head.string()
        elif key == "general.alignment" and kind == 4:
            alignment = head.read("I")
        else:
            head.skip(kind)
    infos = []
    for _ in range(tensor_count):
        name, dims = head.string(), head.read("I")
        shape = tuple(head.read("Q") for _ in range(dims))
        infos.append((name, shape, GGMLQuantizationType(head.read("I")), head.read("Q")))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment {alignment}")
    start = -(-head.at // alignment) * alignment
    tensors = []
    for name, shape, kind, offset in infos:
        elements = int(np.prod(shape))
        block, size = GGML_QUANT_SIZES[kind]
        n_bytes, at = elements * size // block, start + int(offset)
        dims = tuple(reversed(shape))
        if kind.name in _DENSE:
            view = np.frombuffer(data, dtype=_DENSE[kind.name], count=elements, offset=at).reshape(dims)
        else:  # GGUFReader's byte shape: the innermost size counted in bytes of blocks
            view = np.frombuffer(data, dtype=np.uint8, count=n_bytes, offset=at)
            view = view.reshape(*dims[:-1], dims[-1] // block * size)
        tensors.append(StoredTensor(name, kind, shape, n_bytes, at, view))
    if not architecture:
        raise ValueError("no general.architecture")
    return GGUFIndex(architecture, tensors, data)


def read_index(path: str | Path) -> GGUFIndex:
    """The tensors and architecture of the GGUF file ``path`` (see the module docstring); gguf-py's reader where
    this one cannot read the header (its exception then propagates, as its callers expect)."""
    path = Path(path)
    try:
        return _parse(path)
    except (ValueError, struct.error, KeyError, UnicodeDecodeError):
        import gguf

        reader = gguf.GGUFReader(str(path))
        tensors = [
            StoredTensor(t.name, t.tensor_type, tuple(int(s) for s in t.shape), int(t.n_bytes), int(t.data_offset),
                         t.data)
            for t in reader.tensors
        ]  # fmt: skip
        return GGUFIndex(str(reader.fields["general.architecture"].contents()), tensors, reader.data)
