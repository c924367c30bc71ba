"""Where this package keeps what it makes once per machine and reuses: dequantized GGUF folders
(`gguf_dequantized`), the native ops' builds (`kernels.native_ops`), the real test files joined from their parts
(`lattice_testing.real_files`)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$LATTICE_CACHE_DIR``, else ``$XDG_CACHE_HOME/lattice-inference``, else ``~/.cache/lattice-inference``."""
    explicit = os.environ.get("LATTICE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lattice-inference"
