"""``lattice bench --engine local,vllm``: the engines side by side on the same prompts.

Two parts. **Batch 1**: every method on every prompt, one request at a time, on each engine; whole-request
tokens/s (prompt processing included: vLLM's offline engine reports no separate decode time), the speed-up over
the same engine's greedy and ngram, the mean acceptance length and the share of outputs identical to the same
engine's own greedy (plain) output. **Concurrency sweep**: ``lattice serve --engine E`` started as a user would,
then 1, 4, 16 concurrent clients (`lattice_inference.engines.sweep`). Both engines get the same token ids,
encoded once here.

With ``--traces`` the batch-1 part replays multi-request traces (`lattice_inference.traces`) instead: every
request of every trace in order, reported per trace and over all (no sweep). A conversation trace's requests
follow the earlier ones and plain greedy decoding's answers, decoded once by this package before any engine runs,
so every engine and method gets the same prompts. Our cross-request index is cleared at the start of each trace;
vLLM's ``suffix`` cache (arctic-inference's, inside its engine) cannot be cleared from outside, so it also holds
the earlier traces' answers (one engine per method replays all traces).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from lattice_inference import benchmark
from lattice_inference.engines import parse_engines
from lattice_inference.engines.compare_report import format_report, plot_report
from lattice_inference.engines.sweep import sweep
from lattice_inference.errors import ConfigError
from lattice_inference.flags import bench_options
from lattice_inference.models.load import LoadedModel
from lattice_inference.options import (
    DEFAULT_COMPARE_METHODS,
    DEFAULT_TRACE_METHODS,
    DecodeOptions,
    parse_methods,
)
from lattice_inference.prompt_codec import PromptCodec
from lattice_inference.sampling import SamplingOptions, prompt_seed

if TYPE_CHECKING:
    from lattice_inference.traces import Trace

#: One generation: (token ids, wall seconds, drafts (rounds that drafted), drafted tokens, accepted tokens).
Run = tuple[list[int], float, int, int, int]


@dataclass
class Workload:
    """What every engine runs, one request at a time: prompts as token ids with their budgets, the groups of
    requests reported apart (prompt sets, or traces) and where a session begins (a trace's first request: the
    local engine's cross-request index is cleared there)."""

    ids: list[list[int]]
    budgets: list[int]
    groups: dict[str, set[int]] = field(default_factory=dict)
    sessions: frozenset[int] = frozenset()


def prompt_workload(args: argparse.Namespace, encoder: PromptCodec, prompts: list[benchmark.BenchPrompt]) -> Workload:
    """The prompts (``--prompts``, ``--per-kind``, ``--limit``), each with ``--max-new-tokens``, grouped by set."""
    groups: dict[str, set[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p.set or p.kind, set()).add(i)
    ids = [benchmark.encode_prompt(encoder, p, bool(args.chat)) for p in prompts]
    return Workload(ids, [args.max_new_tokens] * len(ids), groups)


def trace_workload(
    traces: list[Trace], encoder: PromptCodec, max_new_tokens: int, answer: Callable[[list[int], int], str] | None
) -> Workload:
    """Every trace's requests in order (`lattice_inference.traces.encode_traces`, conversations answered by
    ``answer``), grouped by trace, each trace a session."""
    from lattice_inference.traces import encode_traces

    work = Workload([], [])
    sessions = set()
    for trace, requests in zip(traces, encode_traces(traces, encoder, max_new_tokens, answer), strict=True):
        sessions.add(len(work.ids))
        work.groups[trace.id] = set(range(len(work.ids), len(work.ids) + len(requests)))
        for ids, budget in requests:
            work.ids.append(ids)
            work.budgets.append(budget)
    work.sessions = frozenset(sessions)
    return work


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--sweep takes comma-separated client counts, got {text!r}") from None
    if any(n < 0 for n in levels):
        raise ConfigError(f"--sweep client counts must be positive, got {text!r}")
    return [n for n in levels if n > 0]


def _seeds(base: DecodeOptions, n: int) -> list[SamplingOptions]:
    """Per-prompt sampling: prompt ``i`` samples with `prompt_seed` (as ``lattice bench``)."""
    s = base.sampling
    return [s if s.greedy else replace(s, seed=prompt_seed(s.seed, i)) for i in range(n)]


def run_local(
    args: argparse.Namespace, loaded: LoadedModel, base: DecodeOptions, methods: list[str], work: Workload
) -> dict[str, list[Run]]:
    """Every method on every request, batch 1, ``--reps`` times after a warm-up, on this package's engine (the
    suffix methods' index cleared where a session begins)."""
    from lattice_inference.api import Generator

    out: dict[str, list[Run]] = {}
    samplings = _seeds(base, len(work.ids))
    for m in methods:
        gen = Generator(loaded.model, loaded.tokenizer, base.updated(method=m), eos_token_ids=loaded.eos_token_ids)
        gen.generate(work.ids[0], max_new_tokens=min(16, work.budgets[0]))
        runs: list[Run] = []
        for _ in range(args.reps):
            gen.clear_suffix_index()
            for i, (prompt, budget, s) in enumerate(zip(work.ids, work.budgets, samplings, strict=True)):
                if i in work.sessions:
                    gen.clear_suffix_index()
                t0 = time.perf_counter()
                r = gen.generate(prompt, budget, seed=s.seed)
                m_ = r.metrics
                runs.append((r.token_ids, time.perf_counter() - t0, m_.drafts, m_.drafted_tokens, m_.accepted_tokens))
        out[m] = runs
    return out


def run_vllm(
    args: argparse.Namespace, base: DecodeOptions, methods: list[str], work: Workload, eos: tuple
) -> dict[str, list[Run]]:
    """The same through vLLM: one engine per method (vLLM fixes the drafter per engine), batch 1."""
    from lattice_inference.engines.vllm.batch import VllmRequest, VllmRun, run_batch
    from lattice_inference.engines.vllm.runtime import find_runtime, vllm_model

    runtime = find_runtime(args.vllm_python)
    model = vllm_model(args.model, args.dtype)
    samplings = _seeds(base, len(work.ids))
    requests = [VllmRequest(p, b, s) for p, b, s in zip(work.ids, work.budgets, samplings, strict=True)]
    runs = [VllmRun(base.updated(method=m), requests * args.reps, warmup=True) for m in methods]
    done = run_batch(runtime, model, runs, eos, engine_args=args.engine_args, threads=args.threads)
    return {m: [vllm_run(o) for o in outs] for m, outs in zip(methods, done, strict=True)}


def vllm_run(out: Any) -> Run:
    """A `VllmOutput` as a `Run` (its draft counters are vLLM's own, where its metrics API gave them)."""
    spec = out.spec
    return (
        out.token_ids,
        out.seconds,
        spec.get("drafts", 0),
        spec.get("drafted_tokens", 0),
        spec.get("accepted_tokens", 0),
    )


def summarise(results: dict[str, list[Run]], keep: set[int] | None = None, n_prompts: int = 1) -> list[dict]:
    """Per method of one engine: tokens/s over all runs, the speed-up over the same engine's greedy and ngram
    (where they ran), identical share against greedy (same prompt, same rep), acceptance rate and mean acceptance
    length (vLLM's definitions); ``keep``: only the runs of these prompt indices (runs are ordered rep by rep,
    ``n_prompts`` per rep)."""
    picked = {
        m: [r for i, r in enumerate(runs) if keep is None or i % n_prompts in keep] for m, runs in results.items()
    }
    greedy = picked["greedy"]
    rows: list[dict[str, Any]] = []
    for m, runs in picked.items():
        tokens, secs = sum(len(r[0]) for r in runs), sum(r[1] for r in runs)
        drafts, drafted, accepted = sum(r[2] for r in runs), sum(r[3] for r in runs), sum(r[4] for r in runs)
        same = sum(r[0] == g[0] for r, g in zip(runs, greedy, strict=True))
        rows.append(
            {
                "method": m,
                "tokens_per_s": tokens / secs if secs else 0.0,
                "identical_share": same / len(runs) if runs else 0.0,
                "acceptance_rate": accepted / drafted if drafted else None,
                "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
                "new_tokens": tokens,
                "runs": len(runs),
            }
        )
    tps = {r["method"]: r["tokens_per_s"] for r in rows}
    for r in rows:
        for name in ("greedy", "ngram"):
            r[f"speedup_vs_{name}"] = r["tokens_per_s"] / tps[name] if tps.get(name) else None
    return rows


def _serve_args(args: argparse.Namespace, engine: str) -> list[str]:
    out = ["--engine", engine, "--method", args.sweep_method, "--dtype", args.dtype, "--log-level", "warning"]
    out += ["--device", args.device]
    out += ["--max-draft", str(args.max_draft)] + (["--fixed-draft"] if args.fixed_draft else [])
    if engine == "local":
        out += ["--max-leaves", str(args.max_leaves)]
    if args.model:
        out += ["--model", args.model]
    if args.threads:
        out += ["--threads", str(args.threads)]
    if engine == "vllm" and args.vllm_python:
        out += ["--vllm-python", args.vllm_python]
    if engine == "vllm" and args.engine_args:
        out += [f"--engine-args={args.engine_args}"]  # "=": the value starts with "--"
    return out


def compare(args: argparse.Namespace) -> int:
    """Run the comparison ``args`` asks for and print it (or ``--json``); ``--plot`` draws it where matplotlib
    is installed."""
    from lattice_inference.engines.vllm.mapping import check_mtp_head, check_sampling, refuse_unsupported
    from lattice_inference.engines.vllm.runtime import find_runtime
    from lattice_inference.models.source import resolve_model, served_name

    engines = parse_engines(args.engine, several=True)
    traces = _load_traces(args)
    methods = parse_methods(args.methods, DEFAULT_TRACE_METHODS if traces else DEFAULT_COMPARE_METHODS)
    levels = [] if traces else _levels(args.sweep)
    base = bench_options(args)
    if "vllm" in engines:  # every refusal before anything runs
        check_mtp_head(getattr(args, "mtp_head", None))
        for m in methods:
            refuse_unsupported(base.updated(method=m))
        cpu_build = find_runtime(args.vllm_python).cpu
        for m in methods:
            check_sampling(m, base.sampling, cpu_build)
    source = resolve_model(args.model)
    report: dict[str, Any] = {"model": source.name, "methods": methods, "batch1": {}, "batch1_sets": {}, "sweep": {}}
    loaded: LoadedModel | None = None
    if "local" in engines or any(t.conversation for t in traces):  # conversations are answered by local greedy
        from lattice_inference.devices import placement
        from lattice_inference.models.load import load_model, torch_dtype

        dtype = args.dtype
        if "vllm" in engines:  # both engines on the same weights: `auto` as vLLM resolves it
            wanted = torch_dtype(dtype, source, ours=False)
            dtype = wanted if isinstance(wanted, str) else str(wanted).removeprefix("torch.")
        loaded = load_model(args.model, dtype=dtype, device=args.device)
        report |= placement(loaded.model)
    if "local" in engines:
        assert loaded is not None
        encoder = PromptCodec(loaded.tokenizer, loaded.eos_token_ids)
    else:
        from lattice_inference.engines.vllm.runtime import vllm_model

        encoder = PromptCodec.from_folder(vllm_model(args.model, args.dtype).location)
    if traces:
        benchmark.log(f"{len(traces)} traces: encoding their requests (conversations answered by local greedy)")
        work = trace_workload(traces, encoder, args.max_new_tokens, _greedy_answer(loaded, base))
        report |= {"traces": len(traces)}
    else:
        prompts = benchmark.load_prompts(args.prompts or benchmark.default_prompts_path(source))
        work = prompt_workload(args, encoder, benchmark.first_per_kind(prompts, args.per_kind)[: args.limit])
    eos = encoder.eos_token_ids
    report |= {"prompts": len(work.ids), "reps": args.reps, "max_new_tokens": args.max_new_tokens}
    for engine in engines if not args.sweep_only else ():
        benchmark.log(f"batch 1 on {engine}: {len(work.ids)} prompts x {args.reps} reps, methods {', '.join(methods)}")
        results = (
            run_local(args, loaded, base, methods, work)  # type: ignore[arg-type]
            if engine == "local"
            else run_vllm(args, base, methods, work, eos)
        )
        report["batch1"][engine] = summarise(results)
        for label, keep in work.groups.items():
            report["batch1_sets"].setdefault(label, {})[engine] = summarise(results, keep, len(work.ids))
    name = served_name(args.model)
    for engine in engines if levels else ():
        benchmark.log(f"concurrency sweep on {engine}: clients {levels}, {args.sweep_requests} requests each")
        found = sweep(engine, _serve_args(args, engine), name, work.ids, levels, args.sweep_requests,
                      args.max_new_tokens, progress=benchmark.log)  # fmt: skip
        report["sweep"][engine] = [level.to_dict() for level in found]
    if args.plot:
        plot_report(report, args.plot)
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def _load_traces(args: argparse.Namespace) -> list[Trace]:
    """``--traces`` (the first ``--limit``), or none; a trace replay runs once (`ConfigError` for ``--reps``
    above 1: a second pass would draft from the first through the engines' cross-request caches)."""
    if not getattr(args, "traces", None):
        return []
    from lattice_inference.traces import AGENTIC_TRACES, load_traces

    if args.reps != 1:
        raise ConfigError(f"--reps {args.reps} with --traces: a trace replay runs once (leave --reps at 1)")
    return load_traces(AGENTIC_TRACES if args.traces == "agentic" else args.traces)[: args.limit]


def _greedy_answer(loaded: LoadedModel | None, base: DecodeOptions) -> Callable[[list[int], int], str] | None:
    """Plain greedy decoding's text for a conversation trace's request, on the local model (None without it)."""
    if loaded is None:
        return None
    from lattice_inference.api import Generator

    greedy = Generator(
        loaded.model, loaded.tokenizer, base.updated(method="greedy"), eos_token_ids=loaded.eos_token_ids
    )
    return lambda ids, budget: greedy.generate(ids, budget).text
