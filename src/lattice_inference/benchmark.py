"""``lattice bench``: every method on the same prompts and model, side by side, with an identical-output check.

For each prompt the methods run one after another (the order rotates between repetitions so that drifts of a
shared machine hit all of them alike). Reported per method: decode tokens/s (total new tokens over total
decode seconds, prefill excluded), the speed-up over greedy measured in the same run, mean acceptance length,
acceptance rate and acceptance per draft position, and the share of prompts whose output is token for token
greedy's. Where prompts carry a reference continuation, the *copy rate* (share of the reference
continuation's tokens, up to the token budget, that greedy reproduces at the same index) and the *repetition
rate* (share of greedy's 4-grams that already occurred earlier in its output) say whether the output is real
copying or a degenerate loop: a speed-up only counts on output that is not degenerate. Every number is
reported for each prompt ``kind`` (copy-heavy and free continuation behave differently by design) and for all
prompts together.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lattice_inference.api import GenerationResult, Generator
from lattice_inference.errors import ConfigError
from lattice_inference.metrics import GenerationMetrics
from lattice_inference.models.source import ModelSource
from lattice_inference.prompt_codec import PromptCodec
from lattice_inference.sampling import SamplingOptions, prompt_seed

#: The grounded task set shipped with the package (the default prompts of models without their own).
GROUNDED_TASKS = Path(__file__).parent / "tasks" / "grounded.jsonl"


@dataclass
class BenchPrompt:
    """One evaluation prompt: plain text (``prompt``) or a conversation (``messages``, sent through the chat
    template); ``kind`` and ``set`` group the report; ``reference`` is the true continuation where known."""

    prompt: str | None = None
    kind: str = "prompt"
    reference: str | None = None
    messages: list[dict[str, str]] | None = None
    set: str | None = None
    id: str | None = None


def default_prompts_path(source: ModelSource) -> Path:
    """The model folder's own ``eval_prompts.jsonl`` where it has one (the bundled model), else the grounded
    task set."""
    own = source.path / "eval_prompts.jsonl"
    if source.kind == "hf" and own.is_file():
        return own
    return GROUNDED_TASKS


def parse_prompt_row(row: object) -> BenchPrompt:
    """One prompt row (`load_prompts`' format) as a `BenchPrompt`; KeyError or TypeError naming what is wrong."""
    if not isinstance(row, dict):
        raise TypeError("not a JSON object")
    messages, prompt = row.get("messages"), row.get("prompt")
    if messages is None and not isinstance(prompt, str):
        raise KeyError("'prompt' (a string) or 'messages' (a list)")
    if messages is not None and not (
        isinstance(messages, list) and messages and all(isinstance(m, dict) and "content" in m for m in messages)
    ):
        raise TypeError("'messages' must be a non-empty list of {role, content} objects")
    return BenchPrompt(
        prompt=prompt,
        kind=str(row.get("kind", "prompt")),
        reference=row.get("reference_continuation", row.get("reference")),
        messages=messages,
        set=row.get("set"),
        id=row.get("id"),
    )


def load_prompts(path: str | Path) -> list[BenchPrompt]:
    """Read a JSONL file of ``{"prompt" | "messages", "kind"?, "set"?, "id"?, "reference_continuation"?}``."""
    out = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read prompts file '{path}': {exc}") from exc
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(parse_prompt_row(json.loads(line)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}:{n}: expected a JSON object with 'prompt' or 'messages' ({exc})") from exc
    if not out:
        raise ConfigError(f"prompts file '{path}' holds no prompts")
    return out


def first_per_kind(prompts: Sequence[BenchPrompt], n: int | None) -> list[BenchPrompt]:
    """The first ``n`` prompts of each kind, in file order (all of them when ``n`` is None)."""
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        seen[p.kind] = seen.get(p.kind, 0) + 1
        if n is None or seen[p.kind] <= n:
            out.append(p)
    return out


def encode_prompt(codec: PromptCodec, p: BenchPrompt, chat: bool = False) -> list[int]:
    """Token ids of a bench prompt: conversations through the chat template, text raw unless ``chat``."""
    if p.messages is not None:
        return codec.encode_messages(p.messages)
    assert p.prompt is not None
    return codec.encode(p.prompt, chat=chat)


def copy_counts(output: Sequence[int], reference: Sequence[int], budget: int) -> tuple[int, int]:
    """(matched, compared): how many of the reference's first ``budget`` tokens ``output`` reproduces at the
    same index, and how many there were. Output past the reference's end is not compared (nothing says what
    the file held there); output that stops early (EOS) misses the tokens it never produced."""
    ref = list(reference[:budget])
    return sum(a == b for a, b in zip(output, ref, strict=False)), len(ref)


def copy_rate(output: Sequence[int], reference: Sequence[int], budget: int | None = None) -> float:
    """Share of the reference's first ``budget`` tokens (all of them by default) that ``output`` reproduces at
    the same index; 0.0 for an empty reference."""
    matched, compared = copy_counts(output, reference, len(reference) if budget is None else budget)
    return matched / compared if compared else 0.0


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
    prefill_s: float = 0.0
    identical: int = 0
    runs: int = 0
    metrics: GenerationMetrics = field(default_factory=GenerationMetrics)
    per_rep_tps: list[float] = field(default_factory=list)

    def add(self, m: GenerationMetrics, same_as_greedy: bool) -> None:
        self.new_tokens += m.new_tokens
        self.decode_s += m.decode_s
        self.prefill_s += m.prefill_s
        self.identical += same_as_greedy
        self.runs += 1
        self.metrics.add(m)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s else 0.0


@dataclass
class _Group:
    """Per-method stats over one set of prompts (one ``kind``, or all of them)."""

    methods: list[str]
    n_prompts: int = 0
    copy_matched: int = 0
    copy_compared: int = 0
    repetition: list[float] = field(default_factory=list)
    stats: dict[str, MethodStats] = field(init=False)
    rep_tokens: dict[str, int] = field(init=False)
    rep_secs: dict[str, float] = field(init=False)

    def __post_init__(self) -> None:
        self.stats = {m: MethodStats(m) for m in self.methods}
        self.start_rep()

    def start_rep(self) -> None:
        self.rep_tokens = dict.fromkeys(self.methods, 0)
        self.rep_secs = dict.fromkeys(self.methods, 0.0)

    def end_rep(self) -> None:
        for m in self.methods:
            secs = self.rep_secs[m]
            self.stats[m].per_rep_tps.append(self.rep_tokens[m] / secs if secs else 0.0)

    def add(self, name: str, m: GenerationMetrics, same_as_greedy: bool) -> None:
        self.stats[name].add(m, same_as_greedy)
        self.rep_tokens[name] += m.new_tokens
        self.rep_secs[name] += m.decode_s

    def report(self) -> dict[str, Any]:
        greedy_tps = self.stats["greedy"].per_rep_tps
        rows = []
        for name in self.methods:
            s = self.stats[name]
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
                    "leaves": s.metrics.leaves,
                    "accepted_leaves": s.metrics.accepted_leaves,
                    "identical_share": s.identical / s.runs if s.runs else 0.0,
                    "new_tokens": s.new_tokens,
                }
            )
        return {
            "prompts": self.n_prompts,
            "greedy_copy_rate": self.copy_matched / self.copy_compared if self.copy_compared else None,
            "greedy_repetition_rate": statistics.fmean(self.repetition) if self.repetition else 0.0,
            "rows": rows,
        }


def _labels(p: BenchPrompt) -> list[str]:
    """The report groups a prompt belongs to: its set (where given), then its kind."""
    return [x for x in dict.fromkeys((p.set, p.kind)) if x]


def run_bench(
    generators: dict[str, Generator],
    prompts: Sequence[BenchPrompt],
    *,
    max_new_tokens: int,
    reps: int = 1,
    chat: bool = False,
    progress: Callable[[str], None] | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    """Run every generator on every prompt ``reps`` times (after one warm-up); return the report dict.

    The report's top level covers all prompts; ``groups`` holds the same report for each prompt ``set`` (e.g.
    grounded, chat) and ``kind`` (e.g. edit, extract, summarise), whose acceptance and speed-ups differ by
    design; ``samples`` holds greedy's output for the first prompt of each kind. Speed-ups are medians over
    repetitions of (method tokens/s) / (greedy tokens/s) within the same repetition.

    A suffix method's cross-request index starts empty in every repetition (the warm-up's and earlier
    repetitions' answers are forgotten): within a repetition it drafts from the earlier prompts' answers, as a
    server would, but never from its own answer to the same prompt.

    When the generators sample (their options' temperature > 0), prompt ``i`` is generated with seed
    ``seed + i`` by every method in every repetition, so "identical" compares each method with plain sampling
    (the ``greedy`` method: no drafter) under the same seed.
    """
    if "greedy" not in generators:
        raise ConfigError("the benchmark needs the greedy method as its reference")
    methods = list(generators)
    greedy = generators["greedy"]
    tokenizer = greedy.tokenizer
    overall = _Group(methods)
    groups = {label: _Group(methods) for p in prompts for label in _labels(p)}
    encoded = [encode_prompt(greedy.codec, p, chat) for p in prompts]
    samples: dict[str, dict[str, Any]] = {}
    sampling = greedy.options.sampling
    if seed is None and not sampling.greedy:
        seed = sampling.seeded().seed
    exactness = _warm_up(generators, encoded[0], max_new_tokens)
    for rep in range(reps):
        for gen in generators.values():
            gen.clear_suffix_index()
        for g in (overall, *groups.values()):
            g.start_rep()
        for i, (p, ids) in enumerate(zip(prompts, encoded, strict=True)):
            order = methods[(rep + i) % len(methods) :] + methods[: (rep + i) % len(methods)]
            outs = {name: generators[name].generate(ids, max_new_tokens, seed=prompt_seed(seed, i)) for name in order}
            greedy_ids = outs["greedy"].token_ids
            mine = (overall, *(groups[label] for label in _labels(p)))
            for name in methods:
                for g in mine:
                    g.add(name, outs[name].metrics, outs[name].token_ids == greedy_ids)
            if rep == 0:
                ref = tokenizer(p.reference, add_special_tokens=False).input_ids if p.reference else []
                repetition = repetition_rate(greedy_ids)
                matched, compared = copy_counts(greedy_ids, ref, max_new_tokens)
                for g in mine:
                    g.n_prompts += 1
                    g.repetition.append(repetition)
                    g.copy_matched += matched
                    g.copy_compared += compared
                if p.kind not in samples:
                    samples[p.kind] = _sample(p.id or f"prompt {i + 1}", len(ids), outs, methods)
            if progress:
                progress(f"rep {rep + 1}/{reps} prompt {i + 1}/{len(prompts)} ({p.kind})")
        for g in (overall, *groups.values()):
            g.end_rep()
    return {
        **overall.report(),
        "reps": reps,
        "exactness": exactness,
        "max_new_tokens": max_new_tokens,
        "sampling": {**sampling.to_dict(), "seed": seed},
        "groups": {k: g.report() for k, g in groups.items()},
        "samples": samples,
    }


def _warm_up(generators: dict[str, Generator], ids: list[int], max_new_tokens: int) -> str:
    """One short generation per method before timing (a drafted method's first runs its target's self-check);
    what the self-check verified (`GenerationMetrics.exactness`)."""
    exactness = ""
    for gen in generators.values():
        exactness = exactness or gen.generate(ids, max_new_tokens=min(16, max_new_tokens)).metrics.exactness
    return exactness


def _sample(name: str, prompt_tokens: int, outs: dict[str, GenerationResult], methods: list[str]) -> dict[str, Any]:
    """A prompt kind's sample for the report: greedy's output and whether each method's tokens equal it."""
    greedy_ids = outs["greedy"].token_ids
    identical = {m: outs[m].token_ids == greedy_ids for m in methods}
    return {"id": name, "prompt_tokens": prompt_tokens, "output": outs["greedy"].text, "identical": identical}


def _format_rows(rows: list[dict[str, Any]]) -> list[str]:
    head = (
        f"{'method':<8} {'tok/s':>8} {'speed-up':>9} {'mean acc len':>13} {'acc rate':>9} {'tok/fwd':>8} "
        f"{'identical':>10}  acceptance per position"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        per = " ".join(f"{x:.2f}" for x in r["acceptance_per_position"]) or "-"
        per_forward = r["new_tokens"] / r["target_forwards"] if r["target_forwards"] else 0.0
        lines.append(
            f"{r['method']:<8} {r['tokens_per_s']:>8.1f} {r['speedup_vs_greedy']:>8.2f}x "
            f"{r['mean_acceptance_length']:>13.2f} {r['acceptance_rate']:>9.1%} {per_forward:>8.2f} "
            f"{r['identical_share']:>10.0%}  {per}"
        )
    return lines


def _quality_line(group: dict[str, Any]) -> str:
    copy = group["greedy_copy_rate"]
    return (
        f"greedy output: copy rate {'n/a' if copy is None else f'{copy:.1%}'}, "
        f"4-gram repetition rate {group['greedy_repetition_rate']:.1%}"
    )


def format_table(report: dict[str, Any]) -> str:
    """The report as fixed-width text tables: one per prompt kind, then all prompts when there are several."""
    groups = report.get("groups") or {}
    sections = [(k, g) for k, g in groups.items()] if len(groups) > 1 else []
    sections.append(("all prompts", report))
    lines: list[str] = []
    for title, g in sections:
        lines.append(f"== {title}: {g['prompts']} prompts ==")
        lines += _format_rows(g["rows"])
        lines.append(_quality_line(g))
        lines.append("")
    lines.append(f"{report['reps']} timed reps after a warm-up, {report['max_new_tokens']} new tokens per prompt")
    if report.get("exactness"):
        lines.append(report["exactness"])
    sampling = report.get("sampling") or {}
    if sampling.get("temperature"):
        knobs = ", ".join(f"{k} {sampling[k]}" for k in ("temperature", "top_k", "top_p", "min_p"))
        lines.append(
            f"sampled ({knobs}), prompt i with seed {sampling['seed']} + i; 'greedy' is plain sampling, the "
            "reference of 'identical'"
        )
    penalties = SamplingOptions(**sampling).penalties() if sampling else {}
    if penalties:
        lines.append("penalties: " + ", ".join(f"{k} {v}" for k, v in penalties.items()))
    return "\n".join(lines)


def format_samples(report: dict[str, Any]) -> str:
    """Greedy's output for the first prompt of each kind (what ``--show`` prints)."""
    lines = []
    for kind, sample in report.get("samples", {}).items():
        marks = [f"{m} {'same' if ok else 'DIFFERENT'}" for m, ok in sample["identical"].items() if m != "greedy"]
        same = ", ".join(marks)
        lines.append(f"== sample output, {kind}: {sample['id']} ({sample['prompt_tokens']} prompt tokens; {same}) ==")
        lines.append(sample["output"].rstrip())
        lines.append("")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str | Path) -> None:
    """Draw speed-up per prompt kind and per-position acceptance to ``path`` (needs the optional matplotlib
    extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib: pip install 'lattice-inference[plot]'") from exc
    groups = report.get("groups") or {"all prompts": report}
    methods = [r["method"] for r in report["rows"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(groups)
    for gi, (kind, g) in enumerate(groups.items()):
        xs = [i + gi * width for i in range(len(methods))]
        ax1.bar(xs, [r["speedup_vs_greedy"] for r in g["rows"]], width=width, label=kind)
        for r in g["rows"]:
            per = r["acceptance_per_position"]
            if per:
                ax2.plot(range(1, len(per) + 1), per, marker="o", label=f"{r['method']} ({kind})")
    ax1.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(methods))], methods)
    ax1.axhline(1.0, color="grey", linewidth=0.8)
    ax1.set_ylabel("decode speed-up over greedy")
    ax1.set_title("speed-up (same run)")
    ax1.legend()
    longest = max((len(r["acceptance_per_position"]) for g in groups.values() for r in g["rows"]), default=0)
    ax2.set_xticks(range(1, longest + 1))
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
