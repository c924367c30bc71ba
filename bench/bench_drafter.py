"""Proposal latency of NgramDrafter vs a linear scan like the reference's, at 1k, 32k and 128k tokens.

History: uniform random tokens from a 32k vocabulary with spans (16..128 tokens) copied from earlier
positions mixed in (about 30 % of the tokens). Each measured step appends one token and then proposes;
the appended token alternates in blocks of 8 between continuing a copy of an earlier span (the suffix
matches, a draft fires) and fresh random tokens (usually no n-gram matches, the linear scan's worst case).
Our time includes the lazy indexing of the appended token. Each history gets at most 10 % longer during
the measurement.

Baselines (same semantics as ``NgramDrafter(match="first")``, checked on every timed step):
- ``linear``: first-occurrence scan of prompt + history for n = max_ngram..min_ngram, using ``list.index``
  to jump to candidate starts (the fast way to write the reference's scan in Python);
- ``naive``: a literal transcription of the reference's window-by-window scan (``find_ngram``).

Run: ``.venv/bin/python bench/bench_drafter.py`` (under 2 minutes).
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys
import time

from lattice_inference.drafters.ngram import NgramDrafter

VOCAB = 32_000
MAX_NGRAM, MIN_NGRAM, MAX_DRAFT = 5, 2, 4


def make_history(size: int, rng: random.Random) -> list[int]:
    """Random tokens with copied spans mixed in."""
    out: list[int] = []
    while len(out) < size:
        # A copy (mean 72 tokens) with probability p, else 16 random tokens: 72p / (72p + 16(1-p)) = 0.3.
        if len(out) > 256 and rng.random() < 0.087:
            length = rng.randint(16, 128)
            start = rng.randrange(0, len(out) - length)
            out.extend(out[start : start + length])
        else:
            out.extend(rng.randrange(VOCAB) for _ in range(16))
    return out[:size]


def linear_propose(history: list[int], k: int = MAX_DRAFT) -> list[int]:
    """First-occurrence scan (list.index jumps to candidates); the trailing self-match is excluded."""
    size = len(history)
    for n in range(min(MAX_NGRAM, size - 1), MIN_NGRAM - 1, -1):
        suffix = history[size - n :]
        head = suffix[0]
        last_start = size - n - 1  # occurrence must end at <= size - 2
        i = 0
        while True:
            try:
                i = history.index(head, i, last_start + 1)
            except ValueError:
                break
            if history[i : i + n] == suffix:
                return history[i + n : i + n + k]
            i += 1
    return []


def naive_propose(history: list[int], k: int = MAX_DRAFT) -> list[int]:
    """The reference's ``find_ngram`` window scan, transcribed literally."""
    size = len(history)
    for n in range(min(MAX_NGRAM, size - 1), MIN_NGRAM - 1, -1):
        suffix = history[size - n :]
        for i in range(size - n):  # windows ending at <= size - 2
            if history[i : i + n] == suffix:
                return history[i + n : i + n + k]
    return []


def step_tokens(history: list[int], steps: int, rng: random.Random) -> list[int]:
    """Tokens to append: blocks of 8 continuing an earlier span, alternating with blocks of 8 random ones."""
    out: list[int] = []
    src = 0
    for s in range(steps):
        if (s // 8) % 2 == 0:
            if s % 8 == 0:
                src = rng.randrange(0, len(history) - 16)
            out.append(history[src + s % 8])
        else:
            out.append(rng.randrange(VOCAB))
    return out


def median_us(samples_ns: list[int]) -> float:
    return statistics.median(samples_ns) / 1000.0


def measure(size: int, rng: random.Random, steps: int, linear_every: int, naive_every: int) -> dict:
    ours: list[int] = []
    linear: list[int] = []
    naive: list[int] = []
    build_ms: list[float] = []
    drafted = 0
    rounds = max(1, min(10, 1000 // max(1, size // 10)))
    per_round = min(steps, max(1, size // 10))
    clock = time.perf_counter_ns
    for _ in range(rounds):
        history = make_history(size, rng)
        drafter = NgramDrafter(MAX_NGRAM, MIN_NGRAM, MAX_DRAFT, match="first")
        t0 = clock()
        state = drafter.start(history)
        state.propose(MAX_DRAFT)  # warm-up: builds the index over the whole history
        build_ms.append((clock() - t0) / 1e6)
        for _ in range(50):  # warm-up of the steady-state path
            state.propose(MAX_DRAFT)
        appended = step_tokens(history, per_round, rng)
        for j, tok in enumerate(appended):
            state.extend([tok])
            history.append(tok)
            t0 = clock()
            draft = state.propose(MAX_DRAFT)
            ours.append(clock() - t0)
            drafted += bool(draft)
            if j % linear_every == 0:
                t0 = clock()
                ref = linear_propose(history)
                linear.append(clock() - t0)
                assert ref == draft, (size, j, ref, draft)
            if j % naive_every == 0:
                t0 = clock()
                ref = naive_propose(history)
                naive.append(clock() - t0)
                assert ref == draft, (size, j, ref, draft)
    return {
        "size": size,
        "ours": median_us(ours),
        "ours_n": len(ours),
        "linear": median_us(linear),
        "linear_n": len(linear),
        "naive": median_us(naive),
        "naive_n": len(naive),
        "build_ms": statistics.median(build_ms),
        "drafted": drafted / len(ours),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1000, help="timed proposals per history length")
    args = parser.parse_args()
    rng = random.Random(args.seed)

    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"python {sys.version.split()[0]}; max_ngram={MAX_NGRAM} min_ngram={MIN_NGRAM} max_draft={MAX_DRAFT}")
    # (history length, linear scan every k-th step, naive scan every k-th step)
    plan = [(1_000, 1, 1), (32_000, 1, 10), (128_000, 4, 50)]
    rows = [measure(size, rng, args.steps, le, ne) for size, le, ne in plan]

    header = (
        f"{'history':>8} | {'ours µs':>8} | {'linear µs':>10} | {'naive µs':>10} | "
        f"{'speed-up':>9} | {'vs naive':>9} | {'index build':>11} | {'drafted':>7} | samples o/l/n"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['size']:>8} | {r['ours']:>8.2f} | {r['linear']:>10.1f} | {r['naive']:>10.1f} | "
            f"{r['linear'] / r['ours']:>8.0f}x | {r['naive'] / r['ours']:>8.0f}x | "
            f"{r['build_ms']:>8.1f} ms | {r['drafted']:>6.0%} | {r['ours_n']}/{r['linear_n']}/{r['naive_n']}"
        )
    at = {r["size"]: r for r in rows}
    big, mid = at[128_000], at[32_000]
    ok_latency = big["ours"] <= 20.0
    speedup = mid["linear"] / mid["ours"]
    ok_speedup = speedup >= 100.0
    verdict = "PASS" if ok_latency and ok_speedup else "FAIL"
    print(
        f"verdict: {verdict}: {big['ours']:.2f} µs per proposal at 128k (target <= 20 µs: "
        f"{'met' if ok_latency else 'missed'}); {speedup:.0f}x faster than the linear scan at 32k "
        f"(target >= 100x: {'met' if ok_speedup else 'missed'})"
    )


if __name__ == "__main__":
    main()
