"""What a batched step costs: one forward over the rows of S sequences against one sequence's forward of as many rows.

Why: continuous batching (issue 40) runs every running request's next token and draft in one forward
(`LeanTarget.forward_batch`). The products see all rows at once, but each sequence attends over its own cache, so a
step of 8 one-row sequences reads 8 caches where a 9-row verification of one sequence reads one. This times both
shapes after ``--context`` tokens of cache per sequence (median of ``--reps`` forwards each, rolled back after
each), and checks that each sequence's batched logits equal its own forward's.

    .venv/bin/python bench/bench_batched_step.py --threads 2 [--model smollm2] [--dtype auto] [--context 600]
        [--kv-cache model,float16]   (several caches: timed in turns, one process)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from bench_serve_concurrency import cpu_line

from lattice_inference.models.load import load_model
from lattice_inference.options import KV_CACHES, check_kv_cache
from lattice_inference.targets import make_target
from lattice_inference.targets.base import Segment

SHAPES = ((2, 1), (4, 1), (8, 1), (16, 1), (8, 2), (8, 4))
"""(sequences, rows each) of the batched steps timed."""


def _medians_ms(runs: list[Callable[[], None]], reps: int) -> list[float]:
    """The median time of each of ``runs``, taking turns rep by rep (so that drift hits them alike)."""
    for run in runs:
        run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(reps):
        for run, spent in zip(runs, times, strict=True):
            start = time.perf_counter()
            run()
            spent.append(time.perf_counter() - start)
    return [1000 * statistics.median(spent) for spent in times]


class Setup:
    """One target (``kv_cache``) over the loaded model with ``count`` sequences of ``context`` tokens each."""

    def __init__(self, model: torch.nn.Module, kv_cache: str, count: int, context: int) -> None:
        self.target = make_target(model, kv_cache=kv_cache)
        if not self.target.batches_sequences:
            raise SystemExit("this target does not batch sequences here (the native layer loop does not run)")
        self.context = context
        self.sequences = [self.target.new_sequence(None) for _ in range(count)]
        for i, sequence in enumerate(self.sequences):
            self.target.prefill(sequence, [(7 * j + 13 * i) % 40000 + 100 for j in range(context)])

    def single(self, rows: int) -> Callable[[], None]:
        def run() -> None:
            self.target.forward(self.sequences[0], [5] * rows)
            self.target.rollback(self.sequences[0], self.context)

        return run

    def batched(self, count: int, rows: int) -> Callable[[], None]:
        def run() -> None:
            self.target.forward_batch([Segment(s, [5] * rows) for s in self.sequences[:count]])
            for s in self.sequences[:count]:
                self.target.rollback(s, self.context)

        return run

    def same_as_alone(self) -> int:
        """How many of 4 sequences' batched logits equal their own forward's."""
        target = self.target
        outputs = target.forward_batch([Segment(s, [5, 6]) for s in self.sequences[:4]])
        same = 0
        for sequence, output in zip(self.sequences[:4], outputs, strict=True):
            target.rollback(sequence, self.context)
            same += torch.equal(target.forward(sequence, [5, 6]), output.logits)
            target.rollback(sequence, self.context)
        return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int)
    parser.add_argument(
        "--kv-cache",
        default="auto",
        help=f"the targets' kv_cache, comma-separated ({', '.join(KV_CACHES)}): several are timed in turns",
    )
    args = parser.parse_args()
    caches = args.kv_cache.split(",")
    for kv in caches:
        check_kv_cache(kv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"command: {' '.join(sys.argv)}\nCPU: {cpu_line()}")
    loaded = load_model(args.model, dtype=args.dtype)
    most = max(s for s, _ in SHAPES)
    setups = [Setup(loaded.model, kv, most, args.context) for kv in caches]
    names = [f"{kv} ({str(s.target.kv_dtype).removeprefix('torch.')}) ms" for kv, s in zip(caches, setups, strict=True)]
    print(f"model {loaded.source} ({loaded.model.dtype}), context {args.context} per sequence, {args.reps} reps")
    step = _medians_ms([s.single(1) for s in setups], args.reps)
    print(f"\n| forward | {' | '.join(names)} | in 1-token steps (first) |\n|---|{'---|' * len(names)}---|")
    print(f"| 1 sequence, 1 row | {' | '.join(f'{t:.2f}' for t in step)} | 1.00 |")
    for count, rows in SHAPES:
        for label, runs in (
            (f"1 sequence, {count * rows} rows", [s.single(count * rows) for s in setups]),
            (f"{count} sequences x {rows} row(s)", [s.batched(count, rows) for s in setups]),
        ):
            times = _medians_ms(runs, args.reps)
            print(f"| {label} | {' | '.join(f'{t:.2f}' for t in times)} | {times[0] / step[0]:.2f} |")
    for name, setup in zip(names, setups, strict=True):
        same = setup.same_as_alone()
        print(f"\n{name.removesuffix(' ms')}: batched logits equal to each sequence's own forward: {same}/4")


if __name__ == "__main__":
    main()
