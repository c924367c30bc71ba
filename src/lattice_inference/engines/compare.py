"""``lattice bench --engine local,vllm``: the engines side by side on the same prompts.

Two parts. **Batch 1**: every method on every prompt, one request at a time, on each engine; whole-request
tokens/s (prompt processing included: vLLM's offline engine reports no separate decode time) and the share of
outputs identical to the same engine's own greedy (plain) output. **Concurrency sweep**: ``lattice serve
--engine E`` started as a user would, then 1, 4, 16 concurrent clients (`lattice_inference.engines.sweep`).
Both engines get the same token ids, encoded once here.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from typing import Any

from lattice_inference import benchmark
from lattice_inference.engines import parse_engines
from lattice_inference.engines.compare_report import format_report, plot_report
from lattice_inference.engines.sweep import sweep
from lattice_inference.errors import ConfigError
from lattice_inference.flags import bench_options
from lattice_inference.loading import LoadedModel
from lattice_inference.options import DecodeOptions, parse_methods
from lattice_inference.prompt_codec import PromptCodec
from lattice_inference.sampling import SamplingOptions, prompt_seed

#: One generation: (token ids, wall seconds, drafted tokens, accepted tokens).
Run = tuple[list[int], float, int, int]


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
    args: argparse.Namespace, loaded: LoadedModel, base: DecodeOptions, methods: list[str], ids: list
) -> dict:
    """Every method on every prompt, batch 1, ``--reps`` times after a warm-up, on this package's engine."""
    from lattice_inference.api import Generator

    out: dict[str, list[Run]] = {}
    samplings = _seeds(base, len(ids))
    for m in methods:
        gen = Generator(loaded.model, loaded.tokenizer, base.updated(method=m), eos_token_ids=loaded.eos_token_ids)
        gen.generate(ids[0], max_new_tokens=min(16, args.max_new_tokens))
        runs: list[Run] = []
        for _ in range(args.reps):
            for prompt, s in zip(ids, samplings, strict=True):
                t0 = time.perf_counter()
                r = gen.generate(prompt, args.max_new_tokens, seed=s.seed)
                runs.append(
                    (r.token_ids, time.perf_counter() - t0, r.metrics.drafted_tokens, r.metrics.accepted_tokens)
                )
        out[m] = runs
    return out


def run_vllm(args: argparse.Namespace, base: DecodeOptions, methods: list[str], ids: list, eos: tuple) -> dict:
    """The same through vLLM: one engine per method (vLLM fixes the drafter per engine), batch 1."""
    from lattice_inference.engines.vllm.batch import VllmRequest, VllmRun, run_batch
    from lattice_inference.engines.vllm.runtime import find_runtime, vllm_model

    runtime = find_runtime(args.vllm_python)
    model = vllm_model(args.model, args.dtype)
    requests = [VllmRequest(p, args.max_new_tokens, s) for p, s in zip(ids, _seeds(base, len(ids)), strict=True)]
    runs = [VllmRun(base.updated(method=m), requests * args.reps, warmup=True) for m in methods]
    done = run_batch(runtime, model, runs, eos, engine_args=args.engine_args, threads=args.threads)
    return {
        m: [(o.token_ids, o.seconds, o.spec.get("drafted_tokens", 0), o.spec.get("accepted_tokens", 0)) for o in outs]
        for m, outs in zip(methods, done, strict=True)
    }


def summarise(results: dict[str, list[Run]], keep: set[int] | None = None, n_prompts: int = 1) -> list[dict]:
    """Per method: tokens/s over all runs, identical share against greedy (same prompt, same rep), acceptance;
    ``keep``: only the runs of these prompt indices (runs are ordered rep by rep, ``n_prompts`` per rep)."""
    picked = {
        m: [r for i, r in enumerate(runs) if keep is None or i % n_prompts in keep] for m, runs in results.items()
    }
    greedy = picked["greedy"]
    rows = []
    for m, runs in picked.items():
        tokens, secs = sum(len(r[0]) for r in runs), sum(r[1] for r in runs)
        drafted, accepted = sum(r[2] for r in runs), sum(r[3] for r in runs)
        same = sum(r[0] == g[0] for r, g in zip(runs, greedy, strict=True))
        rows.append(
            {
                "method": m,
                "tokens_per_s": tokens / secs if secs else 0.0,
                "identical_share": same / len(runs) if runs else 0.0,
                "acceptance_rate": accepted / drafted if drafted else None,
                "new_tokens": tokens,
                "runs": len(runs),
            }
        )
    return rows


def _serve_args(args: argparse.Namespace, engine: str) -> list[str]:
    out = ["--engine", engine, "--method", args.sweep_method, "--dtype", args.dtype, "--log-level", "warning"]
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
    from lattice_inference.model_source import resolve_model
    from lattice_inference.serve.command import served_name

    engines = parse_engines(args.engine, several=True)
    methods, levels = parse_methods(args.methods, ("greedy", "ngram")), _levels(args.sweep)
    base = bench_options(args)
    if "vllm" in engines:  # every refusal before anything runs
        check_mtp_head(getattr(args, "mtp_head", None))
        for m in methods:
            refuse_unsupported(base.updated(method=m))
        cpu_build = find_runtime(args.vllm_python).cpu
        for m in methods:
            check_sampling(m, base.sampling, cpu_build)
    source = resolve_model(args.model)
    prompts = benchmark.load_prompts(args.prompts or benchmark.default_prompts_path(source))
    prompts = benchmark.first_per_kind(prompts, args.per_kind)[: args.limit]
    report: dict[str, Any] = {"model": source.name, "methods": methods, "batch1": {}, "batch1_sets": {}, "sweep": {}}
    sets: dict[str, set[int]] = {}
    for i, p in enumerate(prompts):
        sets.setdefault(p.set or p.kind, set()).add(i)
    loaded: LoadedModel | None = None
    if "local" in engines:
        from lattice_inference.loading import load_model

        loaded = load_model(args.model, dtype=args.dtype)
        encoder = PromptCodec(loaded.tokenizer, loaded.eos_token_ids)
        report["dtype"] = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    else:
        from lattice_inference.engines.vllm.runtime import vllm_model

        folder = vllm_model(args.model, args.dtype).location
        encoder = PromptCodec.from_folder(folder)
    ids = [benchmark.encode_prompt(encoder, p, bool(args.chat)) for p in prompts]
    eos = encoder.eos_token_ids
    report |= {"prompts": len(ids), "reps": args.reps, "max_new_tokens": args.max_new_tokens}
    for engine in engines if not args.sweep_only else ():
        benchmark.log(f"batch 1 on {engine}: {len(ids)} prompts x {args.reps} reps, methods {', '.join(methods)}")
        results = (
            run_local(args, loaded, base, methods, ids)  # type: ignore[arg-type]
            if engine == "local"
            else run_vllm(args, base, methods, ids, eos)
        )
        report["batch1"][engine] = summarise(results)
        for label, keep in sets.items():
            report["batch1_sets"].setdefault(label, {})[engine] = summarise(results, keep, len(ids))
    name = served_name(args.model)
    for engine in engines if levels else ():
        benchmark.log(f"concurrency sweep on {engine}: clients {levels}, {args.sweep_requests} requests each")
        found = sweep(engine, _serve_args(args, engine), name, ids, levels, args.sweep_requests, args.max_new_tokens,
                      progress=benchmark.log)  # fmt: skip
        report["sweep"][engine] = [level.to_dict() for level in found]
    if args.plot:
        plot_report(report, args.plot)
    print(json.dumps(report) if args.json else format_report(report))
    return 0
