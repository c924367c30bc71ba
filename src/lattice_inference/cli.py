"""The ``lattice`` command: lossless speculative generation from the terminal."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lattice_inference.engines import add_engine_arguments, parse_engines
from lattice_inference.errors import ConfigError, LatticeError
from lattice_inference.flags import (
    MODEL_HELP,
    add_decode_arguments,
    add_placement_arguments,
    bench_options,
    decode_options,
    positive_int,
)
from lattice_inference.options import DEFAULT_BENCH_METHODS, DEFAULT_TRACE_METHODS, needs_mtp_head, parse_methods
from lattice_inference.process import settle_after_load

if TYPE_CHECKING:
    from lattice_inference.api import Generator
    from lattice_inference.grammar import Grammar
    from lattice_inference.models.load import LoadedModel
    from lattice_inference.options import DecodeOptions


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``lattice`` command."""
    parser = argparse.ArgumentParser(prog="lattice", description="Lossless speculative decoding for Hugging Face LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
    _add_bench_parser(sub)
    from lattice_inference.serve.command import add_parser as add_serve_parser

    add_serve_parser(sub)
    from lattice_inference.train.command import add_parser as add_train_parser

    add_train_parser(sub, positive_int, MODEL_HELP)
    return parser


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """``lattice generate``'s arguments."""
    gen = sub.add_parser("generate", help="generate text from a prompt, streaming it to stdout")
    gen.add_argument("--model", help=MODEL_HELP)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file ('-' for stdin)")
    gen.add_argument("--max-new-tokens", type=positive_int, default=256, help="generation budget (default 256)")
    add_decode_arguments(gen)
    add_placement_arguments(gen)
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap the prompt in the tokenizer's chat template (default: yes where the tokenizer has one)",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's choice)")
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="the output follows this JSON schema (structured output)")
    shape.add_argument("--regex", help="the output matches this regular expression")
    shape.add_argument(
        "--grammar", metavar="FILE", help="the output follows this grammar: Lark (llguidance's) or llama.cpp's GBNF"
    )
    gen.add_argument(
        "--prediction-file",
        metavar="FILE",
        help="what the output will mostly be (the file an edit reproduces): drafted from first, output unchanged",
    )
    add_engine_arguments(gen)


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """``lattice bench``'s arguments."""
    bench = sub.add_parser("bench", help="run several methods on the same prompts and compare speed and output")
    bench.add_argument("--model", help=MODEL_HELP)
    bench.add_argument(
        "--prompts",
        help="JSONL of {messages | prompt, kind, set?, reference_continuation?} (default: the model folder's "
        "eval_prompts.jsonl where it has one, else the packaged grounded task set)",
    )
    bench.add_argument(
        "--methods",
        help="comma-separated methods; greedy, the reference, is always run (default: greedy,ngram and, where the "
        "checkpoint has its own MTP head or --mtp-head is given, mtp,ngram+mtp)",
    )
    bench.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens per prompt (default 128)")
    add_decode_arguments(bench, method=False)
    bench.add_argument(
        "--traces",
        nargs="?",
        const="agentic",
        help="replay multi-request traces in order instead of prompts: a JSONL of {id, conversation?, requests} "
        "('agentic', the default with no value: the packaged agent traces); methods default to greedy,ngram,suffix; "
        "with --engine local,vllm through each engine",
    )
    bench.add_argument("--limit", type=positive_int, help="use only the first N prompts (traces with --traces)")
    bench.add_argument("--per-kind", type=positive_int, help="use only the first N prompts of each kind")
    bench.add_argument("--reps", type=positive_int, default=1, help="timed repetitions after a warm-up")
    bench.add_argument(
        "--concurrency",
        help="N,M,...: submit every prompt at once and run N at a time in one continuous batch, per method: "
        "aggregate tokens/s, request latency p50/p95, answers identical to each alone",
    )
    add_placement_arguments(bench)
    bench.add_argument("--json", action="store_true", help="print the report as JSON")
    bench.add_argument("--show", action="store_true", help="print one sample output per prompt kind")
    bench.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap plain-text prompts in the chat template (rows with 'messages' always are; default: no)",
    )
    bench.add_argument("--plot", help="write a PNG of speed-up and per-position acceptance (needs matplotlib)")
    bench.add_argument("--threads", type=positive_int, help="torch CPU threads")
    add_engine_arguments(bench, several=True)


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        text = args.prompt
    elif args.prompt_file == "-":
        text = sys.stdin.read()
    else:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read prompt file '{args.prompt_file}': {exc}") from exc
    if not text.strip():
        raise ConfigError("the prompt is empty")
    return text


def _read_prediction(args: argparse.Namespace) -> str | None:
    """The text of ``--prediction-file`` (None where not given)."""
    if args.prediction_file is None:
        return None
    try:
        return Path(args.prediction_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read prediction file '{args.prediction_file}': {exc}") from exc


def quiet_transformers() -> None:
    """Silence transformers' progress bars and info logs so stderr carries only our own lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _generate(args: argparse.Namespace) -> int:
    import torch

    from lattice_inference.api import Generator

    options = decode_options(args)
    text = _read_prompt(args)
    prediction = _read_prediction(args)
    quiet_transformers()
    if parse_engines(args.engine) != ["local"]:
        if args.json_schema or args.regex is not None or args.grammar or prediction is not None:
            raise ConfigError("--json-schema, --regex, --grammar and --prediction-file run on the local engine only")
        from lattice_inference.engines.vllm.generate import generate

        return generate(args, options, text)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = Generator.from_pretrained(
        args.model, dtype=args.dtype, device=args.device, options=options, mtp_head=args.mtp_head
    )
    gen.prepare()  # the self-check and cost calibration belong to loading, not to the request's timings
    settle_after_load()
    prompt_ids = gen.encode(text, chat=gen.has_chat_template if args.chat is None else args.chat)
    grammar = _grammar(gen, args)
    if args.json:
        out = gen.generate(prompt_ids, args.max_new_tokens, grammar=grammar, prediction=prediction)
        payload = {
            "text": out.text,
            "token_ids": out.token_ids,
            "stop_reason": out.stop_reason,
            "method": args.method,
            **gen.placement,
            "seed": out.seed,
            "sampling": out.sampling.to_dict(),
            "metrics": out.metrics.to_dict(),
        }
        if needs_mtp_head(args.method):
            payload["mtp_metrics"] = out.metrics.reference_mtp()
        sys.stdout.write(json.dumps(payload) + "\n")
        return 0
    generation = gen.start(prompt_ids, args.max_new_tokens, grammar=grammar, prediction=prediction)
    for piece in gen.text_stream(generation):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    seed = "" if generation.seed is None else f" seed {generation.seed},"
    print(f"[{args.method}]{seed} {generation.metrics.summary()}", file=sys.stderr)
    return 0


def _grammar(gen: Generator, args: argparse.Namespace) -> Grammar | None:
    """The grammar ``--json-schema``, ``--regex`` or ``--grammar`` gives (None: free output)."""
    if args.regex is not None:
        return gen.grammar(regex=args.regex)
    path, kind = (args.json_schema, "json_schema") if args.json_schema else (args.grammar, "grammar")
    if path is None:
        return None
    from lattice_inference.grammar import grammar_file

    kind, source = grammar_file(path, kind)
    return gen.grammars.get(kind, source)


def _bench_generators(
    args: argparse.Namespace, loaded: LoadedModel, methods: list[str], base: DecodeOptions, explicit: bool
) -> dict[str, Generator]:
    """`lattice bench`'s generators, one per method: MTP methods dropped (with a line saying why) where the model has
    no usable head and the methods were not named, or where its head is this project's trained one (run when asked)."""
    from lattice_inference import benchmark
    from lattice_inference.api import Generator, mtp_head_for
    from lattice_inference.mtp.head_file import shipped_head

    head = None
    if not explicit and args.mtp_head is None and shipped_head(loaded.source) is not None:
        # A head trained by this project for a model without one (SmolLM2): run it when asked, not by default;
        # its card says how far its training got.
        methods = [m for m in methods if not needs_mtp_head(m)]
        benchmark.log("MTP methods need --methods ...,mtp for this model's trained head (see its card)")
    if any(map(needs_mtp_head, methods)):
        try:
            head = mtp_head_for(loaded, base.draft_length, base.draft_vocab, args.mtp_head)
        except LatticeError as exc:
            if explicit:
                raise
            methods = [m for m in methods if not needs_mtp_head(m)]
            benchmark.log(f"no MTP methods: {exc}")
    model, tokenizer, eos = loaded.model, loaded.tokenizer, loaded.eos_token_ids
    return {m: Generator(model, tokenizer, base.updated(method=m), mtp_head=head, eos_token_ids=eos) for m in methods}


def _bench(args: argparse.Namespace) -> int:
    import torch

    from lattice_inference import benchmark
    from lattice_inference.devices import placement
    from lattice_inference.models.load import load_model
    from lattice_inference.models.source import resolve_model

    if parse_engines(args.engine, several=True) != ["local"]:
        from lattice_inference.engines.compare import compare

        quiet_transformers()
        return compare(args)
    from lattice_inference import concurrency_bench

    levels = concurrency_bench.parse_levels(args.concurrency) if args.concurrency else None
    if levels and args.traces:
        raise ConfigError("--concurrency runs prompts at once; --traces replays requests in order: choose one")
    explicit = args.methods is not None
    methods = parse_methods(args.methods, DEFAULT_TRACE_METHODS if args.traces else DEFAULT_BENCH_METHODS)
    base = bench_options(args)
    source = resolve_model(args.model)
    if args.traces:
        from lattice_inference import traces as trace_bench

        traces = trace_bench.load_traces(trace_bench.AGENTIC_TRACES if args.traces == "agentic" else args.traces)
        traces = traces[: args.limit]
    else:
        prompts = benchmark.load_prompts(args.prompts or benchmark.default_prompts_path(source))
        prompts = benchmark.first_per_kind(prompts, args.per_kind)[: args.limit]
    quiet_transformers()
    if args.threads:
        torch.set_num_threads(args.threads)
    benchmark.log(f"loading {source.name} ({source.location})")
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    settle_after_load()
    lm = loaded.model
    generators = _bench_generators(args, loaded, methods, base, explicit)
    methods = list(generators)
    if args.traces:
        benchmark.log(f"{len(traces)} traces, methods {', '.join(methods)}, model {loaded.source}")
        report = trace_bench.run_traces(generators, traces, max_new_tokens=args.max_new_tokens, progress=benchmark.log)
        report["model"] = loaded.source
        report |= placement(lm)
        print(json.dumps(report) if args.json else f"model {loaded.source}\n{trace_bench.format_traces(report)}")
        return 0
    benchmark.log(f"{len(prompts)} prompts, methods {', '.join(methods)}, model {loaded.source}")
    common: dict[str, Any] = dict(
        max_new_tokens=args.max_new_tokens, reps=args.reps, chat=bool(args.chat), progress=benchmark.log
    )
    if levels:
        report = concurrency_bench.run_concurrency(generators, prompts, levels=levels, **common)
    else:
        report = benchmark.run_bench(generators, prompts, **common)
    report["model"] = loaded.source
    report |= placement(lm)
    if levels:
        where = f"model {report['model']} ({report['dtype']}, {report['device']})"
        print(json.dumps(report) if args.json else f"{where}\n{concurrency_bench.format_concurrency(report)}")
        return 0
    if args.plot:
        benchmark.plot(report, args.plot)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"model {report['model']} ({report['dtype']}, {report['device']})")
        print(benchmark.format_table(report))
        if args.show:
            print(benchmark.format_samples(report))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from lattice_inference.serve import command

    quiet_transformers()
    return command.run(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lattice`` command; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "train-mtp":
            from lattice_inference.train import command as train_command

            quiet_transformers()
            return train_command.run(args)
    except LatticeError as exc:
        print(f"lattice: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lattice: interrupted", file=sys.stderr)
        return 130
    return 0


def run() -> None:
    """Console-script wrapper: exit with `main`'s code."""
    sys.exit(main())


if __name__ == "__main__":
    run()
