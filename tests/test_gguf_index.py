"""`gguf_index.read_index` reads a GGUF file's tensors as gguf-py's ``GGUFReader`` gives them (names, types,
shapes, byte counts, offsets, data), without building the metadata values, and falls back to that reader, and its
errors, where it cannot read a header."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from lattice_inference.models.gguf_index import _parse, read_index
from lattice_inference.models.source import smollm2_gguf

from .helpers import skip_without_real_model

skip_without_real_model()


def _same_as_gguf_reader(path: Path) -> None:
    index, reader = _parse(path), gguf.GGUFReader(str(path))
    assert index.architecture == str(reader.fields["general.architecture"].contents())
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(index.tensors, reader.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.shape == tuple(int(s) for s in theirs.shape), mine.name
        assert (mine.n_bytes, mine.data_offset) == (int(theirs.n_bytes), int(theirs.data_offset)), mine.name
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data, theirs.data), mine.name


def test_the_default_models_file_reads_as_gguf_py_reads_it():
    _same_as_gguf_reader(Path(smollm2_gguf()))  # Q4_1, Q8_0 and F32 tensors; a 49152-token vocabulary skipped


@pytest.mark.parametrize("fmt", ["Q8_0", "F32"])
def test_a_written_file_reads_as_gguf_py_reads_it(fmt, tiny_gguf):
    _same_as_gguf_reader(tiny_gguf(fmt))  # bench_quant_sizes.write_gguf(path, "tiny", fmt, ...), once per session


def test_a_header_it_cannot_read_goes_to_gguf_py_and_its_error(tmp_path, monkeypatch):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(smollm2_gguf()).read_bytes()[:4096])  # the header cut short, inside the vocabulary
    with pytest.raises(struct.error):
        _parse(cut)
    called: list[str] = []
    real = gguf.GGUFReader

    def reader(path: str) -> gguf.GGUFReader:
        called.append(path)
        return real(path)

    monkeypatch.setattr(gguf, "GGUFReader", reader)
    with pytest.raises(Exception):  # noqa: B017 - whatever gguf-py raises for it
        read_index(cut)
    assert called == [str(cut)]
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        _parse(not_gguf)
