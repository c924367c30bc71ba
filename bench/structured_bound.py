"""How fast can prompt lookup make constrained decoding on the structured task set? A floor on its rounds, next to
what ``ngram`` does, on the default model.

Why: issue 53 asks constrained ``ngram`` for 2x constrained greedy on whole requests. Every verification round
emits exactly one token that was not drafted (the target's own, after the accepted draft), and a lookup drafter
can only draft a token that the grammar forces, or that followed the previous token somewhere earlier in the
request (prompt or output: a draft is a copy of what followed an earlier occurrence), or that continues earlier
text (`NgramState._spelled_lookup` re-spells text). A token that is none of these must be some round's own token,
so their count is a floor on the rounds of any lookup drafter, however it picks its occurrences and lengths.

For each task of `bench/structured_tasks.jsonl` (its schema as a grammar, batch 1, one generator per method on one
shared target) it runs constrained greedy and ``ngram`` ``--reps`` times, alternating, and prints per task: the new
tokens, those the grammar forces, the undraftable ones (the floor), and ``ngram``'s target forwards. Then the totals
and an optimistic time for that floor: each floor round a one-token forward, every other new token one more row at
the cheapest marginal row cost the target's measured forward costs show (``t(w) - t(1)) / (w - 1)``, least over
widths 2..11), against the measured medians of prefill and decode; that gives the most any lookup drafter could
reach on whole requests on this machine, next to what ``ngram`` reaches.

    .venv/bin/python bench/structured_bound.py --threads 2 --reps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench_serve_concurrency import cpu_line

TASKS = Path(__file__).with_name("structured_tasks.jsonl")


def undraftable(tokenizer: Any, grammar: Any, prompt: list[int], output: list[int]) -> tuple[int, int]:
    """Of ``output`` (after ``prompt``, under ``grammar``): how many tokens the grammar forces, and how many no
    lookup could have drafted (not forced; never after the previous token before; not continuing earlier text:
    the last two characters and the token's own occurring earlier, a token of letters or digits)."""
    state = grammar.state()
    history = list(prompt)
    seen = {(history[i], history[i + 1]) for i in range(len(history) - 1)}
    text = tokenizer.decode(history)
    forced_count = floor = 0
    for token in output:
        forced, spelled = state.forced(1)
        piece = tokenizer.decode([token])
        if token in forced[:1] or token in spelled[:1]:
            forced_count += 1
        elif (history[-1], token) not in seen and not (piece.strip() and text[-2:] + piece in text[:-1]):
            floor += 1
        seen.add((history[-1], token))
        history.append(token)
        text += piece
        state.advance([token])
    return forced_count, floor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--tasks", default=str(TASKS))
    args = ap.parse_args()

    import torch

    from lattice_inference import Generator
    from lattice_inference.loading import load_model
    from lattice_inference.targets.forward_cost import forward_costs

    torch.set_num_threads(args.threads)
    print(cpu_line(), f"{args.threads} threads")
    tasks = [json.loads(line) for line in Path(args.tasks).read_text().splitlines() if line.strip()]
    loaded = load_model("smollm2")
    greedy = Generator(loaded.model, loaded.tokenizer, method="greedy", eos_token_ids=loaded.eos_token_ids,
                       prefix_cache=False)  # fmt: skip
    ngram = Generator(loaded.model, loaded.tokenizer, method="ngram", eos_token_ids=loaded.eos_token_ids,
                      prefix_cache=False, target=greedy.decoder.target)  # fmt: skip
    ngram.prepare()
    costs = forward_costs(greedy.decoder.target, ngram.decoder.widest())
    step = costs.seconds(1)
    row = min((costs.seconds(w) - step) / (w - 1) for w in range(2, 12))
    times: dict[str, dict[str, list[float]]] = {m: {"prefill": [], "decode": []} for m in ("greedy", "ngram")}
    print("| task | new tokens | forced | undraftable (floor) | ngram forwards |")
    print("|---|---|---|---|---|")
    totals = [0, 0, 0, 0]
    for rep in range(args.reps):
        sums = {m: [0.0, 0.0] for m in times}
        for i, task in enumerate(tasks):
            prompt = f"{task['question']}\n\n{task['document']}"
            outs = {}
            for name, gen in (("greedy", greedy), ("ngram", ngram))[:: 1 if i % 2 else -1]:
                outs[name] = gen.generate(
                    prompt, args.max_tokens, chat=True, grammar=gen.grammar(json_schema=task["schema"])
                )
                sums[name][0] += outs[name].metrics.prefill_s
                sums[name][1] += outs[name].metrics.decode_s
            if outs["ngram"].token_ids != outs["greedy"].token_ids:
                raise SystemExit(f"{task['id']}: ngram's output differs from constrained greedy's")
            if rep == 0:
                ids = greedy.codec.encode(prompt, chat=True)
                out = outs["greedy"].token_ids
                forced, floor = undraftable(loaded.tokenizer, greedy.grammar(json_schema=task["schema"]), ids, out)
                forwards = outs["ngram"].metrics.target_forwards
                print(f"| {task['id']} | {len(out)} | {forced} | {floor} | {forwards} |", flush=True)
                for j, v in enumerate((len(out), forced, floor, forwards)):
                    totals[j] += v
        for name, (prefill, decode) in sums.items():
            times[name]["prefill"].append(prefill)
            times[name]["decode"].append(decode)
    new, forced, floor, forwards = totals
    print(f"| all | {new} | {forced} | {floor} | {forwards} |")
    med = {m: {k: statistics.median(v) for k, v in parts.items()} for m, parts in times.items()}
    prefill = statistics.median(med[m]["prefill"] for m in med)
    # the first token of each request comes from the prefill: the floor's rounds emit the rest
    ideal = floor * step + (new - len(tasks) - floor) * row
    g, n = med["greedy"]["decode"], med["ngram"]["decode"]
    print(f"\nforward costs: one token {step * 1e3:.2f} ms, cheapest marginal row {row * 1e3:.2f} ms")
    print(f"prefill {prefill:.3f} s (median over passes, all tasks); decode: greedy {g:.3f} s, ngram {n:.3f} s, "
          f"the floor's {ideal:.3f} s at the least")  # fmt: skip
    print(f"whole requests x greedy: ngram {(prefill + g) / (prefill + n):.2f}x, any lookup drafter at most "
          f"{(prefill + g) / (prefill + ideal):.2f}x; decode alone {g / n:.2f}x, at most {g / ideal:.2f}x")  # fmt: skip
    print(f"(measured {time.strftime('%Y-%m-%d %H:%M')})")


if __name__ == "__main__":
    main()
