"""The suffix index's costs: a proposal at 10k and at 1M indexed tokens, appending, and memory per held token.

Tokens are the bytes of the standard library's sources (real text, with the repetition code has), cut into
"requests" of 2,000 tokens; contexts are taken from held text (so they match) and from fresh text.

    OMP_WAIT_POLICY=PASSIVE nice -n 19 python bench/bench_suffix.py
"""

from __future__ import annotations

import statistics
import sys
import sysconfig
import time
import tracemalloc
from pathlib import Path

from lattice_inference.drafters.suffix_index import SuffixIndex


def stdlib_bytes(limit: int) -> list[int]:
    out: list[int] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        out += path.read_bytes()
        if len(out) >= limit:
            return out[:limit]
    return out


def build(tokens: list[int], budget: int) -> tuple[SuffixIndex, float]:
    index = SuffixIndex(budget)
    start = time.perf_counter()
    for i in range(0, len(tokens), 2000):
        index.begin(tokens[i : i + 2000])
    return index, (time.perf_counter() - start) / len(tokens)


def proposal_us(index: SuffixIndex, contexts: list[list[int]]) -> float:
    times = []
    for ctx in contexts:
        start = time.perf_counter()
        index.match(ctx, 10)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [10_000, 1_000_000]
    tokens = stdlib_bytes(max(sizes) + 200_000)
    fresh = tokens[-200_000:]
    for size in sizes:
        held = tokens[:size]
        index, append_s = build(held, size)
        step = max(1, size // 2000)
        seen = [held[i - 32 : i] for i in range(32, size, step)][:2000]
        new = [fresh[i - 32 : i] for i in range(32, len(fresh), 100)][:2000]
        print(
            f"{size:>9} tokens: proposal {proposal_us(index, seen):6.1f} us (held context), "
            f"{proposal_us(index, new):6.1f} us (fresh context); append {append_s * 1e6:.2f} us/token; "
            f"{index.anchors} anchors"
        )
    size = 200_000
    tracemalloc.start()
    index, _ = build(tokens[:size], size)
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"memory: {current / size:.0f} bytes per held token at {size} tokens ({current / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
