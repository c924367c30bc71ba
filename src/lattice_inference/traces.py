"""``lattice bench --traces``: multi-request workloads (agent loops, tool output fed back, regenerated answers)
replayed in order, where drafting from earlier requests pays.

A trace file is JSONL, one trace per line: ``{"id", "kind"?, "conversation"?, "requests": [{"messages" | "prompt",
"max_new_tokens"?}, ...]}``. With ``conversation`` true each request is sent after every earlier request's
messages and greedy's answers to them (an agent's growing context; every method's answer is greedy's, token for
token, or the identical share says otherwise). Each method replays every trace in order, its cross-request index
cleared at the start of each trace (a trace is one session); the methods take turns request by request, in an
order that rotates, so drifts of a shared machine hit them alike.

Reported per trace and over all traces, for each method: decode tokens/s, the speed-up over greedy and over
per-request ``ngram`` (where it ran), mean acceptance length, tokens per target forward and the share of requests
whose output is greedy's token for token.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lattice_inference.api import Generator
from lattice_inference.benchmark import BenchPrompt, MethodStats, encode_prompt, parse_prompt_row
from lattice_inference.errors import ConfigError
from lattice_inference.prompt_codec import PromptCodec

#: The agentic traces shipped with the package (built by ``tools/build_agentic_traces.py`` from stdlib text).
AGENTIC_TRACES = Path(__file__).parent / "tasks" / "agentic.jsonl"


@dataclass
class Trace:
    """Requests replayed in order; ``conversation``: each one follows the earlier ones and their answers."""

    id: str
    kind: str
    requests: list[BenchPrompt]
    conversation: bool = False
    budgets: list[int | None] | None = None


def _parse_trace(row: object, n: int) -> Trace:
    if not isinstance(row, dict) or not isinstance(row.get("requests"), list) or not row["requests"]:
        raise TypeError("expected an object with a non-empty 'requests' list")
    requests = [parse_prompt_row(r) for r in row["requests"]]
    budgets = [r.get("max_new_tokens") for r in row["requests"]]
    if row.get("conversation") and any(r.messages is None for r in requests):
        raise TypeError("a conversation trace needs 'messages' in every request")
    return Trace(
        id=str(row.get("id", f"trace {n}")),
        kind=str(row.get("kind", "trace")),
        requests=requests,
        conversation=bool(row.get("conversation", False)),
        budgets=budgets,
    )


def load_traces(path: str | Path) -> list[Trace]:
    """Read a trace file (see the module docstring); `ConfigError` naming the line where one is malformed."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read traces file '{path}': {exc}") from exc
    traces = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            traces.append(_parse_trace(json.loads(line), n))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}:{n}: not a trace ({exc})") from exc
    if not traces:
        raise ConfigError(f"traces file '{path}' holds no traces")
    return traces


def encode_request(
    codec: PromptCodec, trace: Trace, i: int, history: list[dict[str, str]], max_new_tokens: int
) -> tuple[list[int], int]:
    """Request ``i`` of ``trace`` as token ids, and its budget (its own ``max_new_tokens``, else
    ``max_new_tokens``). In a conversation trace ``history`` holds the earlier requests' messages and the answers
    given to them; the request's messages are added to it (the caller appends the answer)."""
    request = trace.requests[i]
    budget = (trace.budgets or [None] * len(trace.requests))[i] or max_new_tokens
    if not trace.conversation:
        return encode_prompt(codec, request), budget
    assert request.messages is not None  # `load_traces` checks it
    history += request.messages
    return codec.encode_messages(history), budget


def encode_traces(
    traces: Sequence[Trace],
    codec: PromptCodec,
    max_new_tokens: int,
    answer: Callable[[list[int], int], str] | None = None,
) -> list[list[tuple[list[int], int]]]:
    """Every request of every trace as (token ids, budget), fixed before any engine runs, so that each engine and
    method gets the same prompts: in a conversation trace each request follows the earlier ones and
    ``answer(ids, budget)`` (plain greedy decoding's text; `ConfigError` where a conversation has no ``answer``)."""
    out: list[list[tuple[list[int], int]]] = []
    for trace in traces:
        if trace.conversation and answer is None:
            raise ConfigError(f"trace {trace.id!r} is a conversation: its requests need greedy's answers")
        history: list[dict[str, str]] = []
        requests = []
        for i in range(len(trace.requests)):
            ids, budget = encode_request(codec, trace, i, history, max_new_tokens)
            if answer is not None and trace.conversation:
                history.append({"role": "assistant", "content": answer(ids, budget)})
            requests.append((ids, budget))
        out.append(requests)
    return out


def _row(name: str, s: MethodStats, greedy: MethodStats, ngram: MethodStats | None) -> dict[str, Any]:
    m = s.metrics
    return {
        "method": name,
        "tokens_per_s": s.tokens_per_s,
        "speedup_vs_greedy": s.tokens_per_s / greedy.tokens_per_s if greedy.tokens_per_s else 0.0,
        "speedup_vs_ngram": s.tokens_per_s / ngram.tokens_per_s if ngram and ngram.tokens_per_s else None,
        "mean_acceptance_length": m.mean_acceptance_length,
        "tokens_per_forward": m.new_tokens / m.target_forwards if m.target_forwards else 0.0,
        "identical_share": s.identical / s.runs if s.runs else 0.0,
        "request_s": (s.prefill_s + s.decode_s) / s.runs if s.runs else 0.0,
        "cached_prompt_share": m.cached_prompt_tokens / m.prompt_tokens if m.prompt_tokens else 0.0,
        "leaves": m.leaves,
        "accepted_leaves": m.accepted_leaves,
        "new_tokens": s.new_tokens,
        "requests": s.runs,
    }


def _report(stats: dict[str, MethodStats]) -> list[dict[str, Any]]:
    return [_row(name, s, stats["greedy"], stats.get("ngram")) for name, s in stats.items()]


def run_traces(
    generators: dict[str, Generator],
    traces: Sequence[Trace],
    *,
    max_new_tokens: int,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Replay every trace with every generator (after a warm-up); return the report dict (``rows`` over all
    traces, ``traces`` per trace)."""
    if "greedy" not in generators:
        raise ConfigError("the trace benchmark needs the greedy method as its reference")
    methods = list(generators)
    greedy = generators["greedy"]
    first = encode_prompt(greedy.codec, traces[0].requests[0])
    for gen in generators.values():  # warm-up: the self-check and the first forwards of each shape
        gen.generate(first, max_new_tokens=min(16, max_new_tokens))
    overall = {m: MethodStats(m) for m in methods}
    per_trace: dict[str, dict[str, MethodStats]] = {}
    turn = 0
    for trace in traces:
        stats = per_trace.setdefault(trace.id, {m: MethodStats(m) for m in methods})
        for gen in generators.values():
            gen.clear_suffix_index()
        history: list[dict[str, str]] = []
        for i in range(len(trace.requests)):
            ids, budget = encode_request(greedy.codec, trace, i, history, max_new_tokens)
            order = methods[turn % len(methods) :] + methods[: turn % len(methods)]
            turn += 1
            outs = {name: generators[name].generate(ids, budget) for name in order}
            want = outs["greedy"].token_ids
            for name in methods:
                same = outs[name].token_ids == want
                stats[name].add(outs[name].metrics, same)
                overall[name].add(outs[name].metrics, same)
            if trace.conversation:
                history.append({"role": "assistant", "content": outs["greedy"].text})
            if progress:
                progress(f"trace {trace.id} request {i + 1}/{len(trace.requests)}")
    return {
        "rows": _report(overall),
        "traces": {tid: {"rows": _report(s)} for tid, s in per_trace.items()},
        "max_new_tokens": max_new_tokens,
        "requests": sum(len(t.requests) for t in traces),
    }


def format_traces(report: dict[str, Any]) -> str:
    """The trace report as fixed-width tables: one per trace, then all traces."""
    head = (
        f"{'method':<11} {'tok/s':>8} {'vs greedy':>10} {'vs ngram':>9} {'mean acc len':>13} {'tok/fwd':>8} "
        f"{'leaves (acc)':>13} {'identical':>10} {'s/request':>10} {'cached':>7}"
    )
    lines: list[str] = []
    for title, group in [*report["traces"].items(), ("all traces", report)]:
        lines += [f"== {title} ==", head, "-" * len(head)]
        for r in group["rows"]:
            vs_ngram = "-" if r["speedup_vs_ngram"] is None else f"{r['speedup_vs_ngram']:.2f}x"
            leaves = f"{r['leaves']} ({r['accepted_leaves']})"
            lines.append(
                f"{r['method']:<11} {r['tokens_per_s']:>8.1f} {r['speedup_vs_greedy']:>9.2f}x {vs_ngram:>9} "
                f"{r['mean_acceptance_length']:>13.2f} {r['tokens_per_forward']:>8.2f} {leaves:>13} "
                f"{r['identical_share']:>10.0%} {r['request_s']:>10.3f} {r['cached_prompt_share']:>7.0%}"
            )
        lines.append("")
    lines.append(
        f"{report['requests']} requests, up to {report['max_new_tokens']} new tokens each, after a warm-up; tok/s: "
        "decode only; s/request: prefill and decode; cached: prompt tokens whose cache rows the prefill reused"
    )
    return "\n".join(lines)
