"""Draft trees against chains, side by side: the same MTP head verifying its drafts alone or with runners-up.

Runs greedy, any other method asked for once, and each MTP method asked for twice over the same loaded model and
head: with ``max_leaves 0`` (the draft chain only, ``<method>-chain``) and with ``--max-leaves`` (the planner may
add the head's runners-up as leaves, ``<method>-tree``), on every prompt in every repetition, through `run_bench`
(medians of per-repetition speed-ups over greedy of the same repetition; every output checked against greedy's).
Prints the table and, per method, tokens per target forward, leaves verified and accepted.

Run (from the repository root, after `grep '"set": "chat"' src/lattice_inference/tasks/grounded.jsonl > chat.jsonl`):
``python bench/bench_tree.py --prompts chat.jsonl --methods mtp,ngram+mtp --reps 2 --threads 2``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import torch

from lattice_inference import benchmark
from lattice_inference.api import DecodeOptions, Generator, mtp_head_for
from lattice_inference.cli import quiet_transformers
from lattice_inference.models.load import load_model
from lattice_inference.options import needs_mtp_head


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", required=True, help="JSONL prompt file (lattice bench's format)")
    parser.add_argument(
        "--methods", default="mtp", help="comma-separated methods; the MTP ones (mtp, ngram+mtp) run as chain and tree"
    )
    parser.add_argument("--draft-length", type=int, default=3)
    parser.add_argument("--max-leaves", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--limit", type=int)
    parser.add_argument("--per-kind", type=int, help="only the first N prompts of each kind")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    print("$ python bench/bench_tree.py " + shlex.join(argv if argv is not None else sys.argv[1:]), flush=True)
    torch.set_num_threads(args.threads)
    quiet_transformers()
    loaded = load_model(args.model, dtype=args.dtype)
    head = mtp_head_for(loaded, args.draft_length)
    prompts = benchmark.first_per_kind(benchmark.load_prompts(args.prompts), args.per_kind)[: args.limit]
    base = DecodeOptions(method="greedy", draft_length=args.draft_length)

    def generator(method: str, leaves: int) -> Generator:
        options = base.updated(method=method, max_leaves=leaves)
        return Generator(loaded.model, loaded.tokenizer, options, mtp_head=head, eos_token_ids=loaded.eos_token_ids)

    generators = {"greedy": generator("greedy", 0)}
    for method in args.methods.split(","):
        if needs_mtp_head(method):
            generators[f"{method}-chain"] = generator(method, 0)
            generators[f"{method}-tree"] = generator(method, args.max_leaves)
        else:
            generators[method] = generator(method, 0)
    report = benchmark.run_bench(
        generators, prompts, max_new_tokens=args.max_new_tokens, reps=args.reps, progress=benchmark.log
    )
    print(benchmark.format_table(report))
    for row in report["rows"]:
        per_forward = row["new_tokens"] / row["target_forwards"] if row["target_forwards"] else 0.0
        print(
            f"{row['method']:<16} tokens/forward {per_forward:.2f}  leaves {row['leaves']} "
            f"(accepted {row['accepted_leaves']})  identical {row['identical_share']:.0%}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
