"""``lattice bench --concurrency N,M,...``: requests at once, as a server's clients send them, per method.

For each method and each concurrency ``N``, every prompt is submitted at once and run ``N`` at a time in one
continuous batch (`Generator.generate_many`: a prompt joins as soon as another finishes), and the report gives the
aggregate completion tokens per second (all tokens over the wall time), the median and 95th-percentile request
latency (from submission to the last token, waiting included) and the share of answers identical to plain
decoding of the same prompt alone (the ``greedy`` method, one at a time: the reference). Medians over ``reps``
timed repetitions after a warm-up. The speed-up column divides by the method's own rate at the first
concurrency given (so ``--concurrency 1,8`` reads as "what batching gives").
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from lattice_inference.api import Generator
from lattice_inference.benchmark import BenchPrompt, encode_prompt
from lattice_inference.errors import ConfigError


def parse_levels(text: str) -> list[int]:
    """``"1,4,8"`` -> ``[1, 4, 8]``: positive, distinct, in the order given."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--concurrency takes numbers separated by commas, got {text!r}") from None
    if not levels or any(n < 1 for n in levels) or len(set(levels)) != len(levels):
        raise ConfigError(f"--concurrency takes distinct positive numbers, got {text!r}")
    return levels


def _percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))] if ordered else 0.0


def run_concurrency(
    generators: dict[str, Generator],
    prompts: Sequence[BenchPrompt],
    *,
    levels: Sequence[int],
    max_new_tokens: int,
    reps: int = 1,
    chat: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run every method on all ``prompts`` at each concurrency of ``levels`` (see the module docstring); return the
    report dict (``rows``: one per method and concurrency)."""
    if "greedy" not in generators:
        raise ConfigError("the benchmark needs the greedy method as its reference")
    greedy = generators["greedy"]
    encoded = [encode_prompt(greedy.codec, p, chat) for p in prompts]
    sampling = greedy.options.sampling
    seed = None if sampling.greedy else (sampling.seed if sampling.seed is not None else 0)  # one for every run
    reference = [greedy.generate(ids, max_new_tokens, seed=seed).token_ids for ids in encoded]
    rows: list[dict[str, Any]] = []
    exactness = ""
    for name, generator in generators.items():
        generator.generate_many(encoded[:2], min(16, max_new_tokens), max_batch=2)  # warm-up, self-check
        first_rate = None
        for level in levels:
            rates, latencies, identical, tokens = [], [], 0, 0
            for rep in range(reps):
                generator.clear_suffix_index()
                start = time.perf_counter()
                results = generator.generate_many(encoded, max_new_tokens, max_batch=level, seed=seed)
                wall = time.perf_counter() - start
                tokens = sum(len(r.token_ids) for r in results)
                rates.append(tokens / wall if wall else 0.0)
                latencies += [r.metrics.latency_s for r in results]
                identical += sum(r.token_ids == want for r, want in zip(results, reference, strict=True))
                exactness = exactness or next((r.metrics.exactness for r in results if r.metrics.exactness), "")
                if progress:
                    progress(f"{name} concurrency {level} rep {rep + 1}/{reps}: {rates[-1]:.1f} tok/s")
            rate = statistics.median(rates)
            first_rate = first_rate or rate
            rows.append(
                {
                    "method": name,
                    "concurrency": level,
                    "tokens_per_s": rate,
                    "speedup_vs_first_level": rate / first_rate if first_rate else 0.0,
                    "latency_p50_s": _percentile(latencies, 0.5),
                    "latency_p95_s": _percentile(latencies, 0.95),
                    "identical_share": identical / (len(encoded) * reps) if encoded else 0.0,
                    "new_tokens": tokens,
                }
            )
    return {
        "rows": rows,
        "prompts": len(prompts),
        "reps": reps,
        "levels": list(levels),
        "max_new_tokens": max_new_tokens,
        "exactness": exactness,
    }


def format_concurrency(report: dict[str, Any]) -> str:
    """The report as a fixed-width table."""
    head = f"{'method':<10} {'clients':>7} {'tok/s':>8} {'vs first':>9} {'p50 s':>7} {'p95 s':>7} {'identical':>10}"
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        lines.append(
            f"{r['method']:<10} {r['concurrency']:>7} {r['tokens_per_s']:>8.1f} {r['speedup_vs_first_level']:>8.2f}x "
            f"{r['latency_p50_s']:>7.2f} {r['latency_p95_s']:>7.2f} {r['identical_share']:>10.0%}"
        )
    lines.append(
        f"{report['prompts']} prompts submitted at once, {report['max_new_tokens']} new tokens each, "
        f"median of {report['reps']} reps; identical: to plain decoding of each prompt alone"
    )
    if report.get("exactness"):
        lines.append(report["exactness"])
    return "\n".join(lines)
