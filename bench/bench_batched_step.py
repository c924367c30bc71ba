"""What a batched step costs: one forward over the rows of S sequences against one sequence's forward of as many rows.

Why: continuous batching (issue 40) runs every running request's next token and draft in one forward
(`LeanTarget.forward_batch`). The products see all rows at once, but each sequence attends over its own cache, so a
step of 8 one-row sequences reads 8 caches where a 9-row verification of one sequence reads one. This times both
shapes after ``--context`` tokens of cache per sequence (median of ``--reps`` forwards each, rolled back after
each), and checks that each sequence's batched logits equal its own forward's.

    .venv/bin/python bench/bench_batched_step.py --threads 2 [--model smollm2] [--dtype auto] [--context 600]
        [--kv-cache auto|model|float16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from bench_serve_concurrency import cpu_line

from lattice_inference.loading import load_model
from lattice_inference.options import KV_CACHES
from lattice_inference.targets import make_target
from lattice_inference.targets.base import Segment

SHAPES = ((2, 1), (4, 1), (8, 1), (16, 1), (8, 2), (8, 4))
"""(sequences, rows each) of the batched steps timed."""


def _median_ms(run: Callable[[], None], reps: int) -> float:
    run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--kv-cache", default="auto", choices=KV_CACHES, help="the target's kv_cache (default auto)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"command: {' '.join(sys.argv)}\nCPU: {cpu_line()}")
    loaded = load_model(args.model, dtype=args.dtype)
    target = make_target(loaded.model, kv_cache=args.kv_cache)
    if not target.batches_sequences:
        raise SystemExit("this target does not batch sequences here (the native layer loop does not run)")
    print(
        f"model {loaded.source} ({loaded.model.dtype}, cache {target.kv_dtype}), context {args.context} per "
        f"sequence, {args.reps} reps"
    )
    most = max(s for s, _ in SHAPES)
    sequences = [target.new_sequence(None) for _ in range(most)]
    for i, sequence in enumerate(sequences):
        target.use(sequence)
        target.prefill([(7 * j + 13 * i) % 40000 + 100 for j in range(args.context)])

    def single(rows: int) -> Callable[[], None]:
        def run() -> None:
            target.use(sequences[0])
            target.forward([5] * rows)
            target.rollback(args.context)

        return run

    def batched(count: int, rows: int) -> Callable[[], None]:
        def run() -> None:
            target.forward_batch([Segment(s, [5] * rows) for s in sequences[:count]])
            for s in sequences[:count]:
                target.use(s)
                target.rollback(args.context)

        return run

    step = _median_ms(single(1), args.reps)
    print(f"\n| forward | ms | in 1-token steps |\n|---|---|---|\n| 1 sequence, 1 row | {step:.2f} | 1.00 |")
    for count, rows in SHAPES:
        alone = _median_ms(single(count * rows), args.reps)
        both = _median_ms(batched(count, rows), args.reps)
        print(f"| 1 sequence, {count * rows} rows | {alone:.2f} | {alone / step:.2f} |")
        print(f"| {count} sequences x {rows} row(s) | {both:.2f} | {both / step:.2f} |")
    outputs = target.forward_batch([Segment(s, [5, 6]) for s in sequences[:4]])
    same = 0
    for sequence, output in zip(sequences[:4], outputs, strict=True):
        target.use(sequence)
        target.rollback(args.context)
        same += torch.equal(target.forward([5, 6]), output.logits)
        target.rollback(args.context)
    print(f"\nbatched logits equal to each sequence's own forward: {same}/4")


if __name__ == "__main__":
    main()
