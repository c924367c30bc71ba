"""How fast can prompt lookup make constrained decoding on the structured task set? Two bounds, next to what
``ngram`` does, on the default model.

Why: issue 53 asks constrained ``ngram`` for 2x constrained greedy on whole requests. Every verification round
emits exactly one token that was not drafted (the target's own, after the accepted draft), and a lookup drafter
can only draft a token that the grammar forces, or that followed the previous token somewhere earlier in the
request (prompt or output: a draft is a copy of what followed an earlier occurrence), or that continues earlier
text (`NgramState._spelled_lookup` re-spells text).

- The floor: tokens that are none of these must each be some round's own token, so their count is a floor on the
  rounds of any lookup drafter (optimistic: it assumes the right occurrence and length are always guessed).
- The oracle, measured: a lookup drafter that knows greedy's output (`OracleDrafter`) drafts, at each position, the
  longest agreeing continuation among every occurrence of the context's last 1..``max_ngram`` tokens and ``ngram``'s
  own proposal (its text lookup included), cut where it stops agreeing, and verifies all of it (no planner): no row
  is ever wasted and no occurrence is chosen wrongly, so its whole requests are the fastest any n-gram lookup
  drafter could make with this target's verification costs. Its proposals are computed before the timed passes.

For each task of `bench/structured_tasks.jsonl` (its schema as a grammar, batch 1, one shared target) it runs
constrained greedy, ``ngram`` and the oracle ``--reps`` times, taking turns task by task, every output checked
identical to greedy's, and prints per task the new tokens, those the grammar forces, the floor and each drafter's
target forwards; then per method the medians over passes of prefill and decode seconds, and the ratios to greedy
on whole requests (prefill + decode) and on decode alone. Every measured request and each task's counts are
appended to ``--out`` (JSONL) as they come, so a failure later loses none.

    .venv/bin/python bench/structured_bound.py --threads 2 --reps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_serve_concurrency import RowWriter, cpu_line

from lattice_inference.drafters.base import Drafter, DrafterState, Proposal, Spelling
from lattice_inference.drafters.ngram import NgramDrafter, NgramState

TASKS = Path(__file__).with_name("structured_tasks.jsonl")
METHODS = ("greedy", "ngram", "oracle")


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


def agreeing(candidate: Sequence[int], want: Sequence[int]) -> int:
    """How many leading tokens of ``candidate`` equal ``want``'s."""
    k = 0
    while k < len(candidate) and k < len(want) and candidate[k] == want[k]:
        k += 1
    return k


def best_copies(prompt: list[int], output: list[int], max_ngram: int, limit: int) -> list[list[int]]:
    """For each position ``i`` of ``output``: the longest run of ``output[i:]`` (at most ``limit`` tokens) that
    follows some earlier occurrence of the history's last 1..``max_ngram`` tokens (the history: ``prompt`` and
    ``output[:i]``), as the copy a lookup drafter would make there if it chose the best occurrence."""
    history = list(prompt)
    copies = []
    for i in range(len(output)):
        want, size, best = output[i : i + limit], len(history), []
        for n in range(1, min(max_ngram, size - 1) + 1):
            suffix = history[size - n :]
            for end in range(n - 1, size - 1):
                if history[end] != suffix[-1] or history[end - n + 1 : end + 1] != suffix:
                    continue
                k = agreeing(history[end + 1 : end + 1 + len(want)], want)
                if k > len(best):
                    best = want[:k]
        copies.append(best)
        history.append(output[i])
    return copies


class OracleState(DrafterState):
    """One generation of `OracleDrafter`: ``ngram``'s own state beside the precomputed best copies."""

    def __init__(self, lookup: NgramState, prompt: int, reference: list[int], copies: list[list[int]]) -> None:
        self.lookup, self.prompt, self.reference, self.copies = lookup, prompt, reference, copies

    def under_grammar(self, spelling: Spelling | None = None) -> None:
        self.lookup.under_grammar(spelling)

    def extend(self, token_ids: Sequence[int]) -> None:
        self.lookup.extend(token_ids)

    def propose(self, max_tokens: int) -> Proposal:
        """The longer of the best copy and ``ngram``'s proposal, each cut where it leaves greedy's output."""
        i = len(self.lookup.history) - self.prompt
        want = self.reference[i : i + max_tokens]
        own = self.lookup.propose(max_tokens)
        k = agreeing(own, want)
        copy = self.copies[i][:max_tokens] if i < len(self.copies) else []
        return Proposal(copy if len(copy) > k else own[:k])


class OracleDrafter(Drafter):
    """A lookup drafter that knows each prompt's greedy output (`OracleState`); for measuring a ceiling only."""

    def __init__(self, lookup: NgramDrafter, outputs: dict[tuple[int, ...], tuple[list[int], list[list[int]]]]) -> None:
        self.lookup, self.outputs = lookup, outputs

    def new_state(self, prompt_ids: Sequence[int], sampler: Any = None, suffix_index: Any = None) -> OracleState:
        reference, copies = self.outputs[tuple(prompt_ids)]
        return OracleState(self.lookup.new_state(prompt_ids), len(prompt_ids), reference, copies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--tasks", default=str(TASKS))
    ap.add_argument("--out", help="JSONL the rows are appended to (default: a new file in the temporary folder)")
    args = ap.parse_args()

    import torch

    from lattice_inference import Generator
    from lattice_inference.decode import SpeculativeDecoder
    from lattice_inference.models.load import load_model
    from lattice_inference.options import DecodeOptions

    torch.set_num_threads(args.threads)
    print(cpu_line(), f"{args.threads} threads")
    out_path = Path(
        args.out or Path(tempfile.gettempdir()) / f"structured_bound-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    )
    writer = RowWriter(out_path)
    print(f"[bound] rows go to {out_path} as they come", flush=True)
    writer.write({"what": "run", "cpu": cpu_line(), "threads": args.threads, "reps": args.reps,
                  "started": time.strftime("%Y-%m-%d %H:%M:%S")})  # fmt: skip
    tasks = [json.loads(line) for line in Path(args.tasks).read_text().splitlines() if line.strip()]
    loaded = load_model("smollm2")
    eos = list(loaded.eos_token_ids)
    greedy = Generator(loaded.model, loaded.tokenizer, method="greedy", eos_token_ids=eos, prefix_cache=False)
    target = greedy.decoder.target
    ngram = Generator(loaded.model, loaded.tokenizer, method="ngram", eos_token_ids=eos, prefix_cache=False,
                      target=target)  # fmt: skip
    ngram.prepare()
    prompts = [f"{t['question']}\n\n{t['document']}" for t in tasks]
    ids = [greedy.codec.encode(p, chat=True) for p in prompts]
    grammars = [greedy.grammar(json_schema=t["schema"]) for t in tasks]
    options = DecodeOptions()
    outputs, floors = {}, []
    for task, prompt, grammar in zip(tasks, ids, grammars, strict=True):  # greedy's outputs, the oracle's copies
        out = greedy.decoder.start(prompt, args.max_tokens, grammar=grammar.state()).result().token_ids
        outputs[tuple(prompt)] = (out, best_copies(prompt, out, options.max_ngram, options.max_draft))
        floors.append([task["id"], len(out), *undraftable(loaded.tokenizer, grammar, prompt, out)])
        writer.write({"what": "floor", **dict(zip(("task", "new_tokens", "forced", "floor"), floors[-1], strict=True))})
    lookup = NgramDrafter(eos_token_ids=eos)
    decoders = {
        "greedy": greedy.decoder,
        "ngram": ngram.decoder,
        "oracle": SpeculativeDecoder(
            target, OracleDrafter(lookup, outputs), max_draft=options.max_draft, eos_token_ids=eos, adaptive=False
        ),
    }
    times: dict[str, dict[str, list[float]]] = {m: {"prefill": [], "decode": []} for m in METHODS}
    forwards = {m: [0] * len(tasks) for m in METHODS}
    for rep in range(args.reps):
        sums = {m: [0.0, 0.0] for m in METHODS}
        for i, (prompt, grammar) in enumerate(zip(ids, grammars, strict=True)):
            for method in METHODS[i % 3 :] + METHODS[: i % 3]:
                result = decoders[method].start(prompt, args.max_tokens, grammar=grammar.state()).result()
                if result.token_ids != outputs[tuple(prompt)][0]:
                    raise SystemExit(f"{tasks[i]['id']}: {method}'s output differs from constrained greedy's")
                m = result.metrics
                sums[method][0] += m.prefill_s
                sums[method][1] += m.decode_s
                forwards[method][i] = m.target_forwards
                writer.write({"what": "request", "method": method, "rep": rep, "task": tasks[i]["id"],
                              "prefill_s": round(m.prefill_s, 5), "decode_s": round(m.decode_s, 5),
                              "forwards": m.target_forwards})  # fmt: skip
        for method, (prefill, decode) in sums.items():
            times[method]["prefill"].append(prefill)
            times[method]["decode"].append(decode)
        print(f"[bound] pass {rep + 1}/{args.reps}: decode s " + ", ".join(f"{m} {sums[m][1]:.3f}" for m in METHODS),
              flush=True)  # fmt: skip
    print("\n| task | new tokens | forced | undraftable (floor) | ngram forwards | oracle forwards |")
    print("|---|---|---|---|---|---|")
    for i, (name, new, forced, floor) in enumerate(floors):
        print(f"| {name} | {new} | {forced} | {floor} | {forwards['ngram'][i]} | {forwards['oracle'][i]} |")
    totals = [sum(r[j] for r in floors) for j in (1, 2, 3)]
    print(f"| all | {totals[0]} | {totals[1]} | {totals[2]} | {sum(forwards['ngram'])} | {sum(forwards['oracle'])} |")
    med = {m: {k: statistics.median(v) for k, v in parts.items()} for m, parts in times.items()}
    print("\n| method | prefill s | decode s | whole x greedy | decode x greedy |")
    print("|---|---|---|---|---|")
    g = med["greedy"]
    for m in METHODS:
        whole = (g["prefill"] + g["decode"]) / (med[m]["prefill"] + med[m]["decode"])
        print(f"| {m} | {med[m]['prefill']:.3f} | {med[m]['decode']:.3f} | {whole:.2f}x | "
              f"{g['decode'] / med[m]['decode']:.2f}x |")  # fmt: skip
    print(f"(medians over {args.reps} passes; measured {time.strftime('%Y-%m-%d %H:%M')}; rows in {out_path})")
    writer.close()


if __name__ == "__main__":
    main()
