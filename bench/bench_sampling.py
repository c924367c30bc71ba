"""Cost of keyed sampling in a decode round, against greedy, on the same model and the same rounds.

One round = one target forward of ``[pending] + draft`` (``k + 1`` tokens), the choice of ``k + 1`` tokens, and
the rollback. Timed side by side, round-robin, median of ``--reps`` rounds per variant:

* ``greedy``: argmax of the rows;
* ``sampled T``: `KeyedSampler.choose` at ``--temperature`` (default 0.7) with fresh noise for every row (no
  cache hit: the worst case);
* ``sampled T, top-p``: the same with ``--top-p`` (default 0.9) truncation (a sort of every row);
* ``... choice only``: the choice functions alone, without the forward.

Default: the bundled model (Qwen3.5 hybrid, 4.5 M params, vocab 4096), its checkpoint dtype, k = 3.
Run: ``.venv/bin/python bench/bench_sampling.py --threads 2`` (under a minute).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from lattice_inference.models.load import load_model
from lattice_inference.sampling import GreedySampler, KeyedSampler, SamplingOptions
from lattice_inference.targets import make_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path(__file__).parents[1] / "src/lattice_inference/default_model"))
    parser.add_argument("--k", type=int, default=3, help="draft tokens per round")
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    print("$ " + shlex.join([sys.executable, *sys.argv]))
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    target = make_target(loaded.model)
    prompt = loaded.tokenizer("def add(a, b):\n    return a + b\n" * 8).input_ids
    seq = target.new_sequence()
    target.prefill(seq, prompt)
    tokens = prompt[-1 : -1 - args.k - 1 : -1]
    variants = {
        "sampled T": SamplingOptions(temperature=args.temperature, seed=1),
        "sampled T, top-p": SamplingOptions(temperature=args.temperature, top_p=args.top_p, seed=1),
    }
    greedy = GreedySampler()
    vocab = target.vocab_size
    index = [10_000]

    def sampler_of(options: SamplingOptions):
        def sampled(logits: torch.Tensor) -> list[int]:
            index[0] += len(tokens)  # fresh indices: every row draws new noise
            return KeyedSampler(options, vocab).choose(logits, index[0])

        return sampled

    choosers = {"greedy": lambda x: greedy.choose(x, 0), **{k: sampler_of(o) for k, o in variants.items()}}

    def round_with(choose) -> float:
        start = time.perf_counter()
        position = seq.length
        choose(target.forward(seq, tokens))
        target.rollback(seq, position)
        return time.perf_counter() - start

    logits = target.forward(seq, tokens)
    target.rollback(seq, seq.length - len(tokens))
    times: dict[str, list[float]] = {}
    for _ in range(10):
        for choose in choosers.values():
            round_with(choose)
    for _ in range(args.reps):
        for name, choose in choosers.items():
            times.setdefault(name, []).append(round_with(choose))
            start = time.perf_counter()
            choose(logits)
            times.setdefault(f"{name} choice only", []).append(time.perf_counter() - start)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"model {args.model}, vocab {vocab}, k {args.k}, rows per round {len(tokens)}")
    for k, v in med.items():
        print(f"{k:<30} {v:8.3f} ms")
    for name in variants:
        print(f"{name}: sampling adds {med[name] / med['greedy'] - 1:+.1%} to a round")


if __name__ == "__main__":
    main()
