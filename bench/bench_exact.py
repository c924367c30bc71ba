"""Identical outputs in the dtype users run: every method against plain decoding, decode-matched and batched.

On the real model (default SmolLM2-135M-Instruct) over grounded prompts, for each verification mode (``matched``:
the default, each row of a k-token forward bit for bit the 1-token step's; ``batched``: ``--batched-verify``, the
model's kernels over all rows at once) it runs plain greedy through our target, transformers' greedy ``generate``
on an untouched copy of the model, prompt lookup with the planner and with fixed drafts, the shipped MTP head, and
seeded sampling (plain and prompt lookup, same seed), and prints per method how many outputs equal plain
decoding's (and greedy's equal transformers'), the first divergence, tokens/s and the speed-up over plain decoding
measured in the same pass (after a warm-up). The target's self-check line (widths 2-16) is printed per mode.

    python bench/bench_exact.py --dtype bfloat16 --threads 2 --prompts 12 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from lattice_inference import Generator
from lattice_inference.api import mtp_head_for
from lattice_inference.benchmark import GROUNDED_TASKS, encode_prompt, load_prompts
from lattice_inference.cli import quiet_transformers
from lattice_inference.models.load import load_model
from lattice_inference.targets.exactness import check_exactness


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=12, help="grounded prompts (every other one of the task set)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--modes", default="matched,batched")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    print("command: python " + " ".join(sys.argv))
    loaded = load_model(args.model, dtype=args.dtype)
    reference = load_model(args.model, dtype=args.dtype).model  # untouched: transformers' own kernels
    prompts = [p for p in load_prompts(GROUNDED_TASKS) if p.set == "grounded"][::2][: args.prompts]
    head = mtp_head_for(loaded, 3)
    for mode in args.modes.split(","):
        batched = mode == "batched"
        common = dict(eos_token_ids=loaded.eos_token_ids, batched_verify=batched)
        m, tok = loaded.model, loaded.tokenizer
        gens = {
            "greedy": Generator(m, tok, method="greedy", **common),
            "ngram": Generator(m, tok, method="ngram", **common),
            "ngram fixed": Generator(m, tok, method="ngram", adaptive=False, **common),
            "mtp": Generator(m, tok, method="mtp", draft_length=3, mtp_head=head, **common),
        }
        line = check_exactness(gens["ngram"].decoder.target, 16).line()
        warm = encode_prompt(gens["greedy"], prompts[0])
        for gen in gens.values():  # the first generation calibrates the planner and runs the self-check
            gen.generate(warm, 8)
        sample = dict(temperature=0.8, top_p=0.95)
        same = dict.fromkeys([*gens, "ngram sampled", "hf generate"], 0)
        firsts: dict[str, list[int]] = {name: [] for name in same}
        seconds: dict[str, list[float]] = {name: [] for name in same}
        for i, p in enumerate(prompts):
            ids = encode_prompt(gens["greedy"], p)
            outs = {}
            for name, gen in gens.items():
                start = time.perf_counter()
                result = gen.generate(ids, args.max_new_tokens)
                seconds[name].append(result.metrics.new_tokens / (time.perf_counter() - start))
                outs[name] = result.token_ids
            plain = outs["greedy"]
            with torch.inference_mode():
                hf = reference.generate(
                    torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None
                )[0, len(ids) :].tolist()
            stop = next((j for j, t in enumerate(hf) if t in loaded.eos_token_ids), len(hf))
            outs["hf generate"] = hf[:stop]
            sampled_plain = gens["greedy"].generate(ids, args.max_new_tokens, seed=i, **sample).token_ids
            outs["ngram sampled"] = gens["ngram"].generate(ids, args.max_new_tokens, seed=i, **sample).token_ids
            for name, out in outs.items():
                want = sampled_plain if name == "ngram sampled" else plain
                diverge = first_divergence(out, want)
                same[name] += diverge is None
                if diverge is not None:
                    firsts[name].append(diverge)
        print(f"\n== {mode}: {len(prompts)} grounded prompts, {args.max_new_tokens} new tokens, {args.dtype} ==")
        print(line)
        greedy_speed = statistics.median(seconds["greedy"])
        for name in same:
            speed = f"{statistics.median(seconds[name]):6.1f} tok/s" if seconds[name] else " " * 11
            ratio = f"{statistics.median(seconds[name]) / greedy_speed:5.2f}x" if seconds[name] else "      "
            where = f" first divergences at {sorted(firsts[name])}" if firsts[name] else ""
            ref = "transformers' greedy vs ours" if name == "hf generate" else "vs plain"
            print(f"{name:<14} {same[name]:>2}/{len(prompts)} identical ({ref}) {speed} {ratio}{where}")


if __name__ == "__main__":
    main()
