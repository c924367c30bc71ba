"""`lattice_inference.process`: the model's loading runs on a thread that exits (taking its OpenMP pool with it),
``lattice serve`` loads that way, and the loaded objects are frozen out of the garbage collector's walks."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from lattice_inference.cli import build_parser
from lattice_inference.process import run_on_passing_thread, settle_after_load
from lattice_inference.serve import command


def test_passing_thread_returns_the_result_and_is_gone():
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 41 + 1

    assert run_on_passing_thread(work) == 42
    assert seen[0] is not threading.main_thread()
    assert not seen[0].is_alive()


def test_passing_thread_raises_its_error_here():
    def fail() -> None:
        raise ValueError("bad weights")

    with pytest.raises(ValueError, match="bad weights"):
        run_on_passing_thread(fail)


POOL_PROBE = """
import os, time, torch
from lattice_inference.process import run_on_passing_thread
torch.set_num_threads(2)
x = torch.randn(4_000_000)

def threads():
    return len(os.listdir("/proc/self/task"))

def settled(limit):
    deadline = time.monotonic() + 5
    while threads() > limit and time.monotonic() < deadline:
        time.sleep(0.05)
    return threads()

base = threads()
run_on_passing_thread(lambda: (x + x).sum())  # parallel work: an OpenMP pool on that thread
after_passing = settled(base)
(x + x).sum()  # the same on the main thread: its pool stays
print(base, after_passing, threads())
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")
def test_the_passing_threads_openmp_pool_goes_with_it():
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(POOL_PROBE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    base, after_passing, after_main = map(int, out.stdout.split())
    assert after_main > base, "the probe made no pool on the main thread: it measures nothing"
    assert after_passing == base


class Loaded(Exception):
    """Stops `command.run` right after the load, carrying the thread it ran on."""


def test_serve_loads_on_a_passing_thread(monkeypatch):
    def load(args):
        raise Loaded(threading.current_thread().name)

    monkeypatch.setattr(command, "_load", load)
    args = build_parser().parse_args(["serve", "--model", "bundled"])
    with pytest.raises(Loaded) as caught:
        command.run(args)
    assert str(caught.value) == "lattice-load"


def test_settle_after_load_freezes_what_is_alive():
    kept = [[i] for i in range(1000)]
    try:
        settle_after_load()
        assert gc.get_freeze_count() >= len(kept)
    finally:
        gc.unfreeze()


HEAP_PROBE = """
import ctypes, sys
from lattice_inference.process import release_freed_memory

def anon_mb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise SystemExit("no RssAnon")

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
big = libc.malloc(16 << 20); libc.free(big)  # raises glibc's mmap threshold: 4 MB blocks now come from the heap
blocks = [libc.malloc(4 << 20) for _ in range(64)]
for b in blocks:
    ctypes.memset(b, 1, 4 << 20)
for b in blocks[:-1]:
    libc.free(b)  # the last block, on top of the heap, keeps the freed ones below it in the heap
held = anon_mb()
released = release_freed_memory()
print(held, anon_mb(), released)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap and /proc: Linux")
def test_release_freed_memory_hands_the_heaps_free_pages_back():
    out = subprocess.run([sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True, check=True).stdout
    held, after, released = out.split()
    if released != "True":
        pytest.skip("this C library has no malloc_trim")
    # 63 freed 4 MB blocks (252 MB) stay with the process until handed back
    assert float(held) - float(after) > 200, out
