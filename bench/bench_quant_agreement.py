"""How far a GGUF file run as stored is from the same file dequantized to float32: greedy tokens, side by side.

A GGUF file under ``--dtype auto`` keeps its Q8_0/Q4_0/Q4_1 layers quantized and rounds each row's inputs to 8 bits
per block of 32 (``csrc/quant_linear.cpp``, as llama.cpp does), so it is a model of its own, close to the file
dequantized to float32 (``--dtype float32``) but not equal to it. Per prompt of the grounded task set (``--per-kind``
of each kind), both models decode greedily (``--max-new-tokens``); reported: the tokens before the first
difference, the positions where both emit the same token, and the prompts answered identically. Rows go to
``--out`` (JSONL) as they are measured.

    python bench/bench_quant_agreement.py --per-kind 2 --max-new-tokens 128 --out quant_agreement.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from lattice_inference import Generator
from lattice_inference.benchmark import GROUNDED_TASKS, encode_prompt, first_per_kind, load_prompts
from lattice_inference.cli import quiet_transformers
from lattice_inference.models.load import load_model


def first_difference(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share before they differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--per-kind", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="quant_agreement.jsonl")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    stored, dense = load_model(args.model, dtype="auto"), load_model(args.model, dtype="float32")
    runs = {
        name: Generator(m.model, m.tokenizer, method="greedy", eos_token_ids=m.eos_token_ids)
        for name, m in (("stored", stored), ("float32", dense))
    }
    prompts = first_per_kind(load_prompts(GROUNDED_TASKS), args.per_kind)
    totals = {"prompts": 0, "identical": 0, "prefix": 0, "same_positions": 0, "tokens": 0}
    out = Path(args.out)
    for prompt in prompts:
        ids = encode_prompt(runs["stored"], prompt)
        ours = runs["stored"].generate(ids, max_new_tokens=args.max_new_tokens).token_ids
        theirs = runs["float32"].generate(ids, max_new_tokens=args.max_new_tokens).token_ids
        row = {
            "prompt": prompt.id,
            "kind": prompt.kind,
            "tokens": [len(ours), len(theirs)],
            "prefix": first_difference(ours, theirs),
            "same_positions": sum(x == y for x, y in zip(ours, theirs, strict=False)),
            "identical": ours == theirs,
        }
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        totals["prompts"] += 1
        totals["identical"] += int(row["identical"])
        totals["prefix"] += int(row["prefix"])
        totals["same_positions"] += int(row["same_positions"])
        totals["tokens"] += max(len(ours), len(theirs))
        print(json.dumps(row), flush=True)
    print(
        f"{totals['identical']}/{totals['prompts']} prompts identical; tokens before the first difference: "
        f"{totals['prefix']} of {totals['tokens']} ({totals['prefix'] / max(totals['tokens'], 1):.0%}); same token at "
        f"the same position: {totals['same_positions']} ({totals['same_positions'] / max(totals['tokens'], 1):.0%})"
    )


if __name__ == "__main__":
    main()
