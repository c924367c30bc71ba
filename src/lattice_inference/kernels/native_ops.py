"""The lean forward's native row-wise ops (``csrc/lean_ops.cpp``), built once per machine and cached.

Why: a decode step of a small model is a few hundred tiny operations around its matrix products (norms, rotary
embedding, cache writes, attention, activations, residuals), and PyTorch runs each as a dispatched op with its
own allocations: on SmolLM2-135M that is as much time as the products themselves. The extension does each
layer's row-wise work in four calls (`rms_norm`/`add_rms_norm`, `rope_qk_cache`, `attention`, `silu_mul`), each
computing every row by one fixed sequence of float operations, so a k-row call equals k 1-row calls bit for bit
(the target's exactness self-check confirms it at load).

The same build holds our float32 products (``csrc/rows_linear.cpp``, `rows`: AVX512F or AVX2+FMA, every row one
fixed sequence of fused multiply-adds, so that float32 rows too are the same at any width and reusable) and our
bfloat16 products (``csrc/tile_linear.cpp``, `tiles`): on CPUs with AMX-BF16 they run on
the matrix tiles, on CPUs with AVX512-BF16 but no AMX (AMD Zen 4 and later, Intel Cooper Lake) on its dot-product
instructions; `packed_linear` lays bfloat16 weights out for them and the layer loop calls them directly.
``LATTICE_AMX=0`` runs the AVX512-BF16 kernel on an AMX CPU too (to compare them; each is row-exact). On those
CPUs bfloat16 attention (head size 64 or 128) runs on the same dot products, rounded as transformers' bfloat16
attention rounds (query and probabilities in bfloat16, float32 sums): 1.6-2x faster than in float32 lanes;
``LATTICE_BF16_ATTENTION=0`` keeps the float32 lanes (each is row-exact). And it holds our products over GGUF's
quantized weights (``csrc/quant_linear.cpp``, `quant`: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K in their blocks,
integer dot products).

It is compiled with the machine's C++ compiler for its own CPU (``-O3 -march=native``) on first use, through
``torch.utils.cpp_extension`` (needs a C++ compiler and ninja), into the cache directory
(``$LATTICE_CACHE_DIR``, else ``~/.cache/lattice-inference``) under a key of the source, torch version and CPU
flags; later starts load the built library. Where torch is held to AVX2 (``ATEN_CPU_CAPABILITY=avx2``) the build is
held there too (``-mno-avx512f``: the AVX2 build, what an AVX2-only CPU runs). ``LATTICE_NATIVE=0`` turns it off;
where it cannot be built the lean forward runs its PyTorch path (`block_attention`) and `unavailable` says why.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from lattice_inference.cache_dir import cache_root
from lattice_inference.cpu_features import cpu_flags, native_compiler_flags

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "lean_ops.cpp", CSRC / "tile_linear.cpp", CSRC / "rows_linear.cpp", CSRC / "quant_linear.cpp")
HEADERS = (CSRC / "tile_linear.h", CSRC / "rows_linear.h", CSRC / "quant_linear.h", CSRC / "tensor_checks.h")
FLAGS = ("-O3", "-march=native", "-fopenmp")
"""Compiler flags: the host CPU's instruction set; OpenMP pragmas bind to the runtime torch already loaded."""


def _switched_off(variable: str) -> bool:
    """Whether the environment variable ``variable`` is ``0``/``false``/``no``/``off``."""
    return os.environ.get(variable, "1").strip().lower() in {"0", "false", "no", "off"}


def enabled() -> bool:
    """False when ``LATTICE_NATIVE`` is ``0``/``false``/``no``/``off``."""
    return not _switched_off("LATTICE_NATIVE")


def compiler_flags() -> tuple[str, ...]:
    """`FLAGS`, and where torch is held below the CPU's instruction set (``ATEN_CPU_CAPABILITY=avx2``), the flags
    that hold the build there too (`cpu_features.native_compiler_flags`): the AVX2 build on an AVX-512 CPU."""
    return (*FLAGS, *native_compiler_flags())


def build_directory() -> Path:
    """Where this machine's build lives: keyed by the source, the flags, Python, torch and the CPU's flags."""
    sources = [path.read_text() for path in (*SOURCES, *HEADERS)]
    parts = [*sources, *compiler_flags(), sys.version, torch.__version__, " ".join(sorted(cpu_flags()))]
    key = hashlib.sha256("\n".join(parts).encode())
    return cache_root() / "native" / key.hexdigest()[:16]


STALE_LOCK_S = 600.0
"""A build lock older than this is left by a build that was killed (torch's builders would wait on it forever)."""


def _clear_stale_lock(directory: Path) -> None:
    """Remove the build lock of ``directory`` where a killed build left it (older than `STALE_LOCK_S`)."""
    lock = directory / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
            print(f"lattice: removed a stale build lock ({lock}) left by an interrupted build", file=sys.stderr)
    except OSError:  # no lock, or another process took it away first
        pass


@functools.cache
def _load() -> tuple[ModuleType | None, str | None]:
    if not enabled():
        return None, "LATTICE_NATIVE=0"
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"the native ops are built for x86-64 CPUs, this is {platform.machine()}"
    try:
        from torch.utils import cpp_extension

        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        _clear_stale_lock(directory)
        if not any(directory.glob("*.so")):
            print(f"lattice: building the native ops for this CPU, once (into {directory})", file=sys.stderr)
        module = cpp_extension.load(
            name="lattice_lean_ops",
            sources=[str(path) for path in SOURCES],
            extra_cflags=list(compiler_flags()),
            extra_include_paths=[str(CSRC)],
            build_directory=str(directory),
            verbose=False,
        )
    except Exception as exc:  # a missing compiler or ninja, a failed build: the PyTorch path runs instead
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        reason = f"could not build the native ops ({first})"
        print(f"lattice: {reason}; the lean forward runs its slower PyTorch path", file=sys.stderr)
        return None, reason
    module.prefer_amx(not _switched_off("LATTICE_AMX"))
    module.attention_bf16_dots(bf16_attention_dots())
    return module, None


def ops() -> ModuleType | None:
    """The built extension, or None where it is off or cannot be built (see `unavailable`)."""
    return _load()[0]


def _products(variable: str, available: str) -> ModuleType | None:
    """The built extension where its products behind ``available`` (a function of it that says they run here) are
    built and not turned off by the environment variable ``variable``; else None."""
    if _switched_off(variable):
        return None
    module = ops()
    return module if module is not None and getattr(module, available)() else None


def tiles() -> ModuleType | None:
    """The built extension where its bfloat16 products (``tile_pack``/``tile_linear``, ``csrc/tile_linear.cpp``)
    run here: built for a CPU with AVX512-BF16 (AMX tiles where the OS grants them, `tile_kernel`), and not turned
    off by ``LATTICE_TILES=0`` (then bfloat16 products run on the row kernel, `rows`, or with ``LATTICE_ROWS=0`` on
    oneDNN); else None."""
    return _products("LATTICE_TILES", "tile_linear_available")


def tile_kernel() -> str | None:
    """Which kernel bfloat16 `packed_linear` products run on here: ``"amx"``, ``"avx512_bf16"``, or None (oneDNN's,
    see `tiles`)."""
    module = tiles()
    return None if module is None else str(module.tile_linear_kernel())


def rows() -> ModuleType | None:
    """The built extension where its float32 products (``rows_pack``/``rows_linear``, ``csrc/rows_linear.cpp``: each
    row computed alike at any width) run here: built for a CPU with AVX512F or AVX2 and FMA, and not turned off by
    ``LATTICE_ROWS=0`` (then float32 products run on oneDNN, whose rows are not reusable); else None."""
    return _products("LATTICE_ROWS", "rows_linear_kernel")


def rows_kernel() -> str | None:
    """Which vector instructions float32 `packed_linear` products run on here: ``"avx512"``, ``"avx2"``, or None
    (oneDNN's, see `rows`)."""
    module = rows()
    return None if module is None else str(module.rows_linear_kernel())


def quant() -> ModuleType | None:
    """The built extension where its GGUF-quantized products (``quant_linear``, ``csrc/quant_linear.cpp``: the
    formats of `quant_linear.FORMATS` in their blocks, integer dot products, every row alike at any width) run here:
    built for a CPU with AVX512BW or AVX2 with FMA, and not turned off by ``LATTICE_QUANT=0`` (then GGUF files are
    dequantized at load); else None."""
    return _products("LATTICE_QUANT", "quant_linear_kernel")


def quant_kernel() -> str | None:
    """Which vector instructions quantized products run on here: ``"avx512_vnni"``, ``"avx512"``, ``"avx2"``, with
    ``"+amx_int8"`` where the 32-input formats' products of several rows (Q8_0 from 5, the others from 32) take their
    dots from AMX tiles (``LATTICE_AMX=0``: never), or None (GGUF files are dequantized, see `quant`)."""
    module = quant()
    if module is None:
        return None
    tiles = str(module.quant_linear_tiles())
    return str(module.quant_linear_kernel()) + (f"+{tiles}" if tiles else "")


def product_kernel(dtype: torch.dtype) -> str | None:
    """Which of our kernels packed products of ``dtype`` run on here (`tile_kernel`, `rows_kernel`), else None
    (oneDNN's)."""
    if dtype == torch.bfloat16:
        return tile_kernel()
    return rows_kernel() if dtype == torch.float32 else None


def bf16_attention_dots() -> bool:
    """Whether bfloat16 attention may run on AVX512-BF16 dot products where the build has them: False when
    ``LATTICE_BF16_ATTENTION`` is ``0``/``false``/``no``/``off`` (float32 lanes then, as on other CPUs)."""
    return not _switched_off("LATTICE_BF16_ATTENTION")


def unavailable() -> str | None:
    """Why `ops` is None (one phrase), else None."""
    return _load()[1]
