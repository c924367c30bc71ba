"""A prompt cache on disk (``--prompt-cache DIR``): the keys and values of a prompt's rows, saved when its sequence
ends and reloaded by a later process that asks again about the same document.

A CLI user runs one process per question; the in-memory prefix cache (`prefix_reuse`) dies with each. Here every
sequence of at least `MIN_ROWS` reusable rows (`LeanTarget`'s native layer loop, whose rows are bit for bit what
any later forward computes) is written as one safetensors file: each layer's keys and values of its rows, and in
its metadata the token ids behind them and the *identity* they were computed under. A later prefill takes the file
holding the longest prefix of its prompt, exactly as it would take a kept sequence in memory.

Reusing rows is lossless only where they are exactly what this process would compute, so a file is used only where
its identity is this target's in every part (`identity`): the model's weights (a fingerprint of every tensor's
sampled bytes, so another file, quantization or fine-tune differs), the activations' and the cache's dtypes, the
thread count, the native kernels' build (source, flags, CPU features) and the format version. A file that differs,
or cannot be read, is refused with one line naming why, and never read again by this process. The folder is held
under ``max_bytes``: the least recently used files are deleted first (a file used is touched).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lattice_inference.options import PROMPT_CACHE_SIZE
from lattice_inference.targets.prefix_reuse import reusable_rows

FORMAT = "lattice-prompt-cache/1"
"""The files' format; part of the identity."""

MIN_ROWS = 64
"""Shortest sequence worth a file (shorter prompts cost less to compute than to read)."""

SAMPLE = 4096
"""Elements of each weight tensor the fingerprint hashes, evenly spaced."""


def lattice_version() -> str:
    """This package's installed version (the rows' code is part of a file's identity)."""
    try:
        return metadata.version("lattice-inference")
    except metadata.PackageNotFoundError:  # run from a source tree
        return "source"


def model_fingerprint(model: torch.nn.Module, packed: Sequence[torch.Tensor] = ()) -> str:
    """A short hash of ``model``'s weights: every parameter's and buffer's name, shape, dtype and `SAMPLE` evenly
    spaced elements (all of a small tensor's), and the same of the ``packed`` weights that replaced some of them
    (those left on the meta device count by shape only), so that another checkpoint, quantization or fine-tune of
    the same architecture gives another fingerprint, in well under a second for any size."""
    digest = hashlib.sha256()
    tensors = sorted([*model.named_parameters(), *model.named_buffers()], key=lambda item: item[0])
    tensors += [(f"packed.{i}", tensor) for i, tensor in enumerate(packed)]
    for name, tensor in tensors:
        if tensor.is_meta:
            digest.update(f"{name}:{tuple(tensor.shape)}:meta".encode())
            continue
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // SAMPLE)
        sample = flat[::step][:SAMPLE].to("cpu").contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return digest.hexdigest()[:32]


@dataclass
class _Entry:
    tokens: list[int]
    identity: dict[str, str]


class PromptStore:
    """The files of one folder (see the module docstring) for a target of ``identity``."""

    def __init__(
        self, directory: str | os.PathLike[str], identity: dict[str, str], max_bytes: int = PROMPT_CACHE_SIZE * 2**20
    ):
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(f"--prompt-cache {directory}: cannot make the folder ({exc.strerror})") from exc
        self.identity = dict(identity)
        self.max_bytes = max_bytes
        self._entries: dict[Path, _Entry | None] = {}  # path -> its metadata (None: refused), read once
        self.loaded = 0
        """Rows read back from files so far."""

    def _scan(self) -> dict[Path, _Entry]:
        """The folder's usable files (each one's metadata read once: a file's name is its tokens' hash, so a file of
        one name never changes); refused ones said once."""
        usable: dict[Path, _Entry] = {}
        for path in sorted(self.directory.glob("*.safetensors")):
            if path not in self._entries:
                self._entries[path] = self._read(path)
            entry = self._entries[path]
            if entry is not None:
                usable[path] = entry
        return usable

    def _read(self, path: Path) -> _Entry | None:
        """``path``'s metadata, or None after one line saying why it is refused."""
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            identity = json.loads(meta["identity"])
            tokens = [int(t) for t in json.loads(meta["tokens"])]
        except Exception as exc:  # a partial, foreign or corrupt file
            self._refuse(path, f"it cannot be read as a prompt cache file ({type(exc).__name__})")
            return None
        differs = [k for k in sorted(set(identity) | set(self.identity)) if identity.get(k) != self.identity.get(k)]
        if differs:
            what = ", ".join(f"{k} {identity.get(k)!r} here {self.identity.get(k)!r}" for k in differs)
            self._refuse(path, f"it was saved under another {what}")
            return None
        return _Entry(tokens, identity)

    @staticmethod
    def _refuse(path: Path, why: str) -> None:
        print(f"lattice: prompt cache: not using {path.name}: {why}", file=sys.stderr, flush=True)

    def best(self, prompt: Sequence[int]) -> tuple[Path | None, int]:
        """The file holding the longest prefix of ``prompt`` (at most ``len(prompt) - 1`` rows: the last prompt
        row is always fed) and how many rows of it; ``(None, 0)`` where none holds any."""
        found, most = None, 0
        for path, entry in self._scan().items():
            common = reusable_rows(entry.tokens, prompt)
            if common > most:
                found, most = path, common
        return found, most

    def load(self, path: Path, rows: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first ``rows`` keys and values of each layer of ``path`` (``[1, kv_heads, rows, head_dim]``), on
        ``device``; the file is touched (recently used)."""
        layers = []
        with safe_open(str(path), framework="pt") as f:
            count = len([name for name in f.keys() if name.startswith("k.")])
            for i in range(count):
                k, v = f.get_slice(f"k.{i}"), f.get_slice(f"v.{i}")
                layers.append((k[:, :, :rows, :].to(device), v[:, :, :rows, :].to(device)))
        os.utime(path)
        self.loaded += rows
        return layers

    def save(self, tokens: Sequence[int], layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Path | None:
        """Write a sequence's rows (``tokens``; each layer's keys and values ``[1, kv_heads, len(tokens), dim]``)
        unless a file holds them already; files whose tokens are a prefix of these are replaced (this one holds
        theirs too). Then the least recently used files go until the folder fits ``max_bytes``. Returns the file
        written (None: nothing new, or too short)."""
        tokens = [int(t) for t in tokens]
        if len(tokens) < MIN_ROWS:
            return None
        usable = self._scan()
        if any(entry.tokens[: len(tokens)] == tokens for entry in usable.values()):
            return None
        name = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:24]
        path = self.directory / f"{name}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for i, (k, v) in enumerate(layers):
            tensors[f"k.{i}"] = k[..., : len(tokens), :].contiguous().cpu()
            tensors[f"v.{i}"] = v[..., : len(tokens), :].contiguous().cpu()
        meta = {"identity": json.dumps(self.identity, sort_keys=True), "tokens": json.dumps(tokens)}
        handle, temporary = tempfile.mkstemp(dir=self.directory, suffix=".partial")
        os.close(handle)
        try:
            save_file(tensors, temporary, metadata=meta)
            os.replace(temporary, path)  # whole or not at all
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        for old, entry in usable.items():
            if entry.tokens == tokens[: len(entry.tokens)] and old != path:
                old.unlink(missing_ok=True)
                self._entries.pop(old, None)
        self._bound()
        return path

    def _bound(self) -> None:
        """Delete the least recently used files until the folder's files fit ``max_bytes``."""
        files = []
        for path in self.directory.glob("*.safetensors"):
            try:
                stat = path.stat()
            except OSError:
                continue
            files.append((stat.st_mtime, stat.st_size, path))
        files.sort()
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            self._entries.pop(path, None)
            total -= size
