"""Variants of decoding options side by side on the agentic traces, in one run (greedy is the reference).

Each variant is ``NAME=METHOD[:FIELD=VALUE...]`` with `DecodeOptions` fields and JSON values, e.g.

    python bench/ab_traces.py "adaptive=suffix" "fixed=suffix:adaptive=false" "min1=suffix:min_ngram=1"

Every variant gets its own `Generator` (its own cache, planner history and cross-request index), measured at load
(`Generator.prepare`), and the variants take turns request by request as in ``lattice bench --traces``, whose
report this prints (decode tokens/s, speed-up over greedy, tokens per forward, identical-output share).
"""

from __future__ import annotations

import argparse
import json

import torch

from lattice_inference import traces
from lattice_inference.api import Generator
from lattice_inference.cli import quiet_transformers
from lattice_inference.models.load import load_model
from lattice_inference.options import DecodeOptions


def parse_variant(spec: str) -> tuple[str, dict[str, object]]:
    """``NAME=METHOD[:FIELD=VALUE...]`` as the name and the `DecodeOptions` fields it sets."""
    name, _, rest = spec.partition("=")
    method, *fields = rest.split(":")
    if not name or not method:
        raise SystemExit(f"variant {spec!r}: expected NAME=METHOD[:FIELD=VALUE...]")
    settings: dict[str, object] = {"method": method}
    for field in fields:
        key, _, value = field.partition("=")
        settings[key] = json.loads(value)
    return name, settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", help="NAME=METHOD[:FIELD=VALUE...]")
    parser.add_argument("--model", default=None, help="as `lattice bench --model` (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--traces", default=None, help="a trace JSONL (default: the packaged agentic traces)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    loaded = load_model(args.model, dtype=args.dtype)

    def generator(settings: dict[str, object]) -> Generator:
        options = DecodeOptions().updated(**settings)
        return Generator(loaded.model, loaded.tokenizer, options, eos_token_ids=loaded.eos_token_ids)

    generators = {"greedy": generator({"method": "greedy"})}
    for spec in args.variants:
        name, settings = parse_variant(spec)
        if name in generators:
            raise SystemExit(f"variant name {name!r} used twice")
        generators[name] = generator(settings)
        generators[name].prepare()
    trace_list = traces.load_traces(args.traces or traces.AGENTIC_TRACES)
    report = traces.run_traces(generators, trace_list, max_new_tokens=args.max_new_tokens)
    print(f"model {loaded.source}\n{traces.format_traces(report)}")


if __name__ == "__main__":
    main()
