"""Text tables and the plot of ``lattice bench --engine local,vllm`` (`lattice_inference.engines.compare`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lattice_inference.benchmark import log


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _batch_lines(report: dict[str, Any]) -> list[str]:
    head = (
        f"{'engine':<7} {'method':<10} {'tok/s':>8} {'vs greedy':>10} {'vs ngram':>9} {'vs local greedy':>16} "
        f"{'identical':>10} {'acc rate':>9} {'mean acc len':>13}"
    )
    lines = [head, "-" * len(head)]
    local = {r["method"]: r for r in report["batch1"].get("local", [])}
    reference = local.get("greedy", {}).get("tokens_per_s")
    for engine, rows in report["batch1"].items():
        for r in rows:
            acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.1%}"
            length = "-" if r.get("mean_acceptance_length") is None else f"{r['mean_acceptance_length']:.2f}"
            lines.append(
                f"{engine:<7} {r['method']:<10} {r['tokens_per_s']:>8.1f} {_ratio(r.get('speedup_vs_greedy')):>10} "
                f"{_ratio(r.get('speedup_vs_ngram')):>9} "
                f"{_ratio(r['tokens_per_s'] / reference if reference else None):>16} {r['identical_share']:>10.0%} "
                f"{acc:>9} {length:>13}"
            )
    return lines


def _sweep_lines(report: dict[str, Any]) -> list[str]:
    sweeps = report["sweep"]
    engines = list(sweeps)
    head = f"{'clients':>7}" + "".join(f" | {e + ' tok/s':>12} {'p50 s':>7} {'p95 s':>7}" for e in engines)
    if {"local", "vllm"} <= set(engines):
        head += " | vllm/local"
    lines = [head, "-" * len(head)]
    by_clients = {e: {lv["clients"]: lv for lv in levels} for e, levels in sweeps.items()}
    for clients in sorted({c for levels in by_clients.values() for c in levels}):
        row = f"{clients:>7}"
        for e in engines:
            lv = by_clients[e].get(clients)
            row += f" | {lv['tokens_per_s']:>12.1f} {lv['p50_s']:>7.2f} {lv['p95_s']:>7.2f}" if lv else " | -"
        local, vllm = by_clients.get("local", {}).get(clients), by_clients.get("vllm", {}).get(clients)
        if local and vllm and local["tokens_per_s"]:
            row += f" | {vllm['tokens_per_s'] / local['tokens_per_s']:>9.2f}x"
        lines.append(row)
    return lines


def format_report(report: dict[str, Any]) -> str:
    """The comparison as fixed-width tables: batch 1 per engine and method (over all prompts, then per prompt set
    or trace), then the concurrency sweep."""
    if "traces" in report:
        n = report["traces"]
        what = f"{n} trace{'s' * (n != 1)}, {report['prompts']} requests in order, up to {report['max_new_tokens']}"
    else:
        what = f"{report['prompts']} prompts x {report['reps']} reps, {report['max_new_tokens']}"
    lines = [f"model {report['model']} ({report.get('dtype', 'dtype per engine')}), {what} new tokens"]
    if report["batch1"]:
        lines += [
            "== batch 1: whole-request tokens/s (prompt processing included); vs greedy, vs ngram, identical: "
            "against the same engine's own greedy and ngram ==",
            *_batch_lines(report),
        ]
    sets = report.get("batch1_sets") or {}
    kind = "trace" if "traces" in report else "prompt set"
    for label, by_engine in sets.items() if len(sets) > 1 else ():
        lines += ["", f"-- batch 1, {kind} {label} only --", *_batch_lines({"batch1": by_engine})]
    if report["sweep"]:
        lines += ["", "== concurrency sweep through lattice serve: aggregate tokens/s, request latency ==",
                  *_sweep_lines(report)]  # fmt: skip
    return "\n".join(lines)


def plot_report(report: dict[str, Any], path: str | Path) -> None:
    """Batch-1 tokens/s per engine and method, and the sweep's aggregate tokens/s per client count, to
    ``path``; without matplotlib (the ``plot`` extra) it says so and draws nothing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"no plot written to {path}: matplotlib is missing (pip install 'lattice-inference[plot]')")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    engines = list(report["batch1"])
    methods = report["methods"]
    width = 0.8 / max(1, len(engines))
    for i, engine in enumerate(engines):
        tps = {r["method"]: r["tokens_per_s"] for r in report["batch1"][engine]}
        ax1.bar([j + i * width for j in range(len(methods))], [tps.get(m, 0) for m in methods], width, label=engine)
    ax1.set_xticks([j + width * (len(engines) - 1) / 2 for j in range(len(methods))], methods)
    ax1.set_ylabel("tokens/s (batch 1, whole request)")
    ax1.set_title("batch 1")
    ax1.legend()
    for engine, levels in report["sweep"].items():
        ax2.plot([lv["clients"] for lv in levels], [lv["tokens_per_s"] for lv in levels], marker="o", label=engine)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("concurrent clients")
    ax2.set_ylabel("aggregate tokens/s")
    ax2.set_title("through lattice serve")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
