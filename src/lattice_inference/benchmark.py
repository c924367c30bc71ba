"""``lattice bench``: every method on the same prompts and model, side by side, with an identical-output check.

For each prompt the methods run one after another (the order rotates between repetitions so that drifts of a
shared machine hit all of them alike). Reported per method: decode tokens/s (total new tokens over total
decode seconds, prefill excluded), the speed-up over greedy measured in the same run, mean acceptance length,
acceptance rate and acceptance per draft position, and the share of prompts whose output is token for token
greedy's. Where prompts carry a reference continuation, the *copy rate* (share of greedy's tokens that equal
the reference continuation's token at the same index) and the *repetition rate* (share of greedy's 4-grams
that already occurred earlier in its output) say whether the output is real copying or a degenerate loop: a
speed-up only counts on output that is not degenerate.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lattice_inference.api import Generator
from lattice_inference.errors import ConfigError
from lattice_inference.metrics import GenerationMetrics


@dataclass
class BenchPrompt:
    """One evaluation prompt; ``reference`` is the true continuation where known."""

    prompt: str
    kind: str = "prompt"
    reference: str | None = None


def load_prompts(path: str | Path) -> list[BenchPrompt]:
    """Read a JSONL file of ``{"prompt", "kind"?, "reference_continuation"?}`` objects."""
    out = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read prompts file '{path}': {exc}") from exc
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append(BenchPrompt(row["prompt"], row.get("kind", "prompt"), row.get("reference_continuation")))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}:{n}: expected a JSON object with a 'prompt' field ({exc})") from exc
    if not out:
        raise ConfigError(f"prompts file '{path}' holds no prompts")
    return out


def copy_rate(output: Sequence[int], reference: Sequence[int]) -> float:
    """Share of ``output`` tokens equal to ``reference``'s token at the same index."""
    if not output:
        return 0.0
    return sum(a == b for a, b in zip(output, reference, strict=False)) / len(output)


def repetition_rate(output: Sequence[int], n: int = 4) -> float:
    """Share of ``output``'s n-grams that already occurred earlier in it (high means looping)."""
    grams = [tuple(output[i : i + n]) for i in range(len(output) - n + 1)]
    if not grams:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams)


@dataclass
class MethodStats:
    """Aggregated results of one method over all prompts and repetitions."""

    method: str
    new_tokens: int = 0
    decode_s: float = 0.0
    identical: int = 0
    runs: int = 0
    metrics: GenerationMetrics = field(default_factory=GenerationMetrics)
    per_rep_tps: list[float] = field(default_factory=list)

    def add(self, m: GenerationMetrics, same_as_greedy: bool) -> None:
        self.new_tokens += m.new_tokens
        self.decode_s += m.decode_s
        self.identical += same_as_greedy
        self.runs += 1
        agg = self.metrics
        agg.new_tokens += m.new_tokens
        agg.target_forwards += m.target_forwards
        agg.drafts += m.drafts
        agg.drafted_tokens += m.drafted_tokens
        agg.accepted_tokens += m.accepted_tokens
        agg.drafter_forwards += m.drafter_forwards
        for i, (a, d) in enumerate(zip(m.accepted_per_position, m.drafted_per_position, strict=True)):
            if i >= len(agg.drafted_per_position):
                agg.drafted_per_position.append(0)
                agg.accepted_per_position.append(0)
            agg.drafted_per_position[i] += d
            agg.accepted_per_position[i] += a

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s else 0.0


def run_bench(
    generators: dict[str, Generator],
    prompts: Sequence[BenchPrompt],
    *,
    max_new_tokens: int,
    reps: int = 1,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run every generator on every prompt ``reps`` times (after one warm-up); return the report dict."""
    if "greedy" not in generators:
        raise ConfigError("the benchmark needs the greedy method as its reference")
    methods = list(generators)
    stats = {name: MethodStats(name) for name in methods}
    tokenizer = generators["greedy"].tokenizer
    quality = {"copy_rate": [], "repetition_rate": []}
    encoded = [generators["greedy"].encode(p.prompt) for p in prompts]
    for gen in generators.values():  # warm-up
        gen.generate(encoded[0], max_new_tokens=min(16, max_new_tokens))
    for rep in range(reps):
        rep_tokens = dict.fromkeys(methods, 0)
        rep_secs = dict.fromkeys(methods, 0.0)
        for i, (p, ids) in enumerate(zip(prompts, encoded, strict=True)):
            order = methods[(rep + i) % len(methods) :] + methods[: (rep + i) % len(methods)]
            outs = {name: generators[name].generate(ids, max_new_tokens=max_new_tokens) for name in order}
            reference_ids = outs["greedy"].token_ids
            for name in methods:
                m = outs[name].metrics
                stats[name].add(m, outs[name].token_ids == reference_ids)
                rep_tokens[name] += m.new_tokens
                rep_secs[name] += m.decode_s
            if rep == 0:
                quality["repetition_rate"].append(repetition_rate(reference_ids))
                if p.reference is not None:
                    ref = tokenizer(p.reference, add_special_tokens=False).input_ids
                    quality["copy_rate"].append(copy_rate(reference_ids, ref))
            if progress:
                progress(f"rep {rep + 1}/{reps} prompt {i + 1}/{len(prompts)} ({p.kind})")
        for name in methods:
            stats[name].per_rep_tps.append(rep_tokens[name] / rep_secs[name] if rep_secs[name] else 0.0)
    greedy_tps = stats["greedy"].per_rep_tps
    rows = []
    for name in methods:
        s = stats[name]
        ratios = [a / b for a, b in zip(s.per_rep_tps, greedy_tps, strict=True) if b]
        rows.append(
            {
                "method": name,
                "tokens_per_s": statistics.median(s.per_rep_tps),
                "speedup_vs_greedy": statistics.median(ratios) if ratios else 0.0,
                "mean_acceptance_length": s.metrics.mean_acceptance_length,
                "acceptance_rate": s.metrics.acceptance_rate,
                "acceptance_per_position": s.metrics.acceptance_per_position,
                "target_forwards": s.metrics.target_forwards,
                "drafter_forwards": s.metrics.drafter_forwards,
                "identical_share": s.identical / s.runs if s.runs else 0.0,
                "new_tokens": s.new_tokens,
            }
        )
    mean = statistics.fmean
    return {
        "prompts": len(prompts),
        "reps": reps,
        "max_new_tokens": max_new_tokens,
        "greedy_copy_rate": mean(quality["copy_rate"]) if quality["copy_rate"] else None,
        "greedy_repetition_rate": mean(quality["repetition_rate"]),
        "rows": rows,
    }


def format_table(report: dict[str, Any]) -> str:
    """The report as a fixed-width text table."""
    head = (
        f"{'method':<8} {'tok/s':>8} {'speed-up':>9} {'mean acc len':>13} {'acc rate':>9} {'identical':>10}"
        "  acceptance per position"
    )
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        per = " ".join(f"{x:.2f}" for x in r["acceptance_per_position"]) or "-"
        lines.append(
            f"{r['method']:<8} {r['tokens_per_s']:>8.1f} {r['speedup_vs_greedy']:>8.2f}x "
            f"{r['mean_acceptance_length']:>13.2f} {r['acceptance_rate']:>9.1%} {r['identical_share']:>10.0%}  {per}"
        )
    copy = report["greedy_copy_rate"]
    lines.append(
        f"greedy output: copy rate {'n/a' if copy is None else f'{copy:.1%}'}, "
        f"4-gram repetition rate {report['greedy_repetition_rate']:.1%} "
        f"({report['prompts']} prompts x {report['reps']} reps, {report['max_new_tokens']} new tokens each)"
    )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str | Path) -> None:
    """Draw speed-up and per-position acceptance to ``path`` (needs the optional matplotlib extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib: pip install 'lattice-inference[plot]'") from exc
    rows = report["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar([r["method"] for r in rows], [r["speedup_vs_greedy"] for r in rows], color="tab:blue")
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_ylabel("decode speed-up over greedy")
    ax1.set_title("speed-up (same run)")
    for r in rows:
        per = r["acceptance_per_position"]
        if per:
            ax2.plot(range(1, len(per) + 1), per, marker="o", label=r["method"])
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("acceptance")
    ax2.set_ylim(0, 1.05)
    ax2.set_title("acceptance per draft position")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def log(message: str) -> None:
    """Progress line on stderr."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)
