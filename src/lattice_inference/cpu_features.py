"""What this CPU computes natively, as far as torch is allowed to use it: one answer for the dtype ``auto`` picks and
for the instruction set the native ops are compiled for.

CPUs differ (AVX2 only: float32 native, bfloat16 emulated; AVX512_BF16: bfloat16 dot products; AMX: bfloat16
tiles), and torch can be held below what the CPU has with ``ATEN_CPU_CAPABILITY`` (``avx2``, ``default``), as
oneDNN can with ``ONEDNN_MAX_CPU_ISA``. When torch is held to AVX2, the native ops are built without AVX-512 too
(`native_compiler_flags`) and bfloat16 counts as emulated (`has_native_bf16`), so that one machine can run the
whole package as an AVX2-only CPU would: ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch

__all__ = ["cpu_flags", "has_native_bf16", "isa_ceiling", "native_compiler_flags"]

_HELD_FLAGS = {
    "avx2": ("-mno-avx512f",),
    "default": ("-mno-avx", "-mno-avx2", "-mno-fma", "-mno-avx512f"),
}
"""Compiler flags that keep the native ops below AVX-512 (``avx2``) or below AVX (``default``), beside
``-march=native`` (``-mno-avx512f`` turns off every AVX-512 extension, AVX512_BF16 and the AMX kernels' guard
included)."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset(platform.processor().split())
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def isa_ceiling() -> str:
    """The widest vector instructions torch runs here: ``"avx512"`` (AVX-512 and its extensions, as the CPU has
    them), ``"avx2"`` or ``"default"`` (torch's ``get_cpu_capability``, which ``ATEN_CPU_CAPABILITY`` can lower
    below the CPU's own); other architectures answer their own name, lower-cased."""
    capability = torch.backends.cpu.get_cpu_capability().lower()
    return "avx512" if capability.startswith("avx512") else capability


def has_native_bf16() -> bool:
    """Whether bfloat16 is computed natively here (AVX512_BF16 or AMX, and torch not held below AVX-512): without
    it torch emulates bfloat16 products, and a bfloat16 model runs slower than float32, its prefill several times
    slower (bench/RESULTS.md)."""
    flags = cpu_flags()
    return isa_ceiling() == "avx512" and ("avx512_bf16" in flags or "amx_bf16" in flags)


def native_compiler_flags() -> tuple[str, ...]:
    """Flags added to the native ops' ``-march=native`` build so that it uses no wider instructions than torch
    runs (`isa_ceiling`): none where torch uses AVX-512."""
    return _HELD_FLAGS.get(isa_ceiling(), ())
