"""What a process that runs a model sets once, after loading it: which thread does the CPU work, and what the
garbage collector looks at.

**Threads.**

torch's CPU kernels (and ours, through ``at::parallel_for``) run on GNU OpenMP, which keeps one pool of worker
threads per thread that starts parallel work, for as long as that thread lives. Once the pools together hold more
threads than the machine has cores, libgomp stops letting any worker spin between parallel regions: each one
sleeps and is woken again for the next region (its "throttled" spin count). A decode step is hundreds of short
parallel regions, so it pays a wake-up for each. Measured on a 2-core EPYC (bfloat16 native), SmolLM2's Q4_1 file,
`ngram`, six requests: 3.0-3.3 s on the thread that loaded the model, 5.4-6.1 s on a second thread while the first
one lived (its pool still counted), 3.0 s on a second thread once the loading thread had exited. ``lattice
serve`` loaded the model on its main thread and generated on a worker thread: every request ran at the slow
rate, 82-90 tokens/s for one client where the same requests ran at 165 in a script.

`run_on_passing_thread` runs the loading (and the load-time checks) on a thread that exits when done, so the
thread that later generates holds the process's only pool. (A program of one thread, such as ``lattice generate``,
loads and generates on its main thread and needs none of this.)

**Garbage collection.** Loading a model leaves a few hundred thousand Python objects (modules, parameters, the
tokenizer's tables), and each full collection of the cyclic garbage collector walks all of them: 4 % of a
250-token prefill's time in a profile (same machine). `settle_after_load` collects once and then freezes what is
left (`gc.freeze`), so later collections walk only what the requests allocate. Frozen objects are still freed
when nothing refers to them; only cycles among them would stay.

**Freed memory.** glibc's allocator keeps what is freed in its heap for reuse and raises its threshold for serving
large blocks from fresh mappings once one is freed (up to 32 MB), so the per-tensor buffers of a load (each a few
MB to tens of MB) end as free heap that the process still holds: 0.8 GB of 2.5 GB after loading a Q4_0 file at
SmolLM2-1.7B's shape. `release_freed_memory` hands it back (``malloc_trim``); loading calls it after each large
tensor and `settle_after_load` once more.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["release_freed_memory", "run_on_passing_thread", "settle_after_load"]

T = TypeVar("T")


def run_on_passing_thread(fn: Callable[[], T], name: str = "lattice-load") -> T:
    """Run ``fn`` on a new thread, wait for it and return its result (or raise its exception here); the thread,
    and the OpenMP worker pool its parallel work made, are gone when this returns (see the module docstring)."""
    result: list[T] = []
    error: list[BaseException] = []

    def body() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # re-raised on the calling thread
            error.append(exc)

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def settle_after_load() -> None:
    """Collect garbage once and freeze the objects left (the loaded model's), so that later collections skip them
    (see the module docstring)."""
    gc.collect()
    gc.freeze()
    release_freed_memory()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Return the C heap's free pages to the system (see the module docstring); False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
