"""What a grammar engine costs per token on the CPU: llguidance, xgrammar and outlines-core on one tokenizer and schema.

Why: issue 53 constrains every row a round verifies with a grammar's token mask, so the engine's time per mask is
added to each decode step (the target: at most 5 % of a step; SmolLM2's step is about 6 ms here). This compiles
one JSON schema per engine (timed: compile once, then the matcher), then walks a valid output token by token: at each
position the engine computes the allowed-token mask over the whole vocabulary and advances by the output's token
(the median of the mask times is reported, and whether every token of the output was allowed). Where an engine
offers them, it also reports the tokens the grammar forces at the start (what a drafter may add for free).

    .venv/bin/python bench/bench_grammar_engines.py [--model smollm2] [--reps 5]

The engines are not dependencies of the package: install them beside it (``pip install --no-deps llguidance
outlines-core``; xgrammar needs ``apache-tvm-ffi`` too, and pulls torch, transformers and triton unless ``--no-deps``).
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench_serve_concurrency import cpu_line

from lattice_inference.models.load import load_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "status": {"enum": ["active", "inactive"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "status", "address"],
    "additionalProperties": False,
}
OUTPUT = (
    '{"name": "Ada Lovelace", "age": 36, "tags": ["mathematics", "poetry", "engines"], "status": "active", '
    '"address": {"city": "London", "zip": "W1J 0BD"}}'
)


def _llguidance(tokenizer: Any, ids: list[int], vocab: int) -> dict[str, object]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - start
    forced = matcher.compute_ff_tokens()
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    times, allowed = [], True
    for token in ids:
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - start)
        allowed &= bool((int(mask[0, token // 32]) >> (token % 32)) & 1)
        if not matcher.consume_token(token):
            allowed = False
            break
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "times": times, "allowed": allowed, "forced": forced}


def _xgrammar(tokenizer: Any, ids: list[int], vocab: int) -> dict[str, object]:
    import xgrammar as xg

    start = time.perf_counter()
    info = xg.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xg.GrammarCompiler(info)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    matcher = xg.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - start
    mask = xg.allocate_token_bitmask(1, vocab)
    times, allowed = [], True
    for token in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - start)
        allowed &= bool((int(mask[0, token // 32]) >> (token % 32)) & 1)
        if not matcher.accept_token(token):
            allowed = False
            break
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "times": times, "allowed": allowed, "forced": None}


def _outlines_core(tokenizer: Any, ids: list[int], vocab: int) -> dict[str, object]:
    import outlines_core

    start = time.perf_counter()
    vocabulary = _outlines_vocabulary(tokenizer)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = outlines_core.Index(regex, vocabulary)
    guide = outlines_core.Guide(index)
    compile_s = time.perf_counter() - start
    times, allowed = [], True
    for token in ids:
        start = time.perf_counter()
        tokens = guide.get_tokens()
        times.append(time.perf_counter() - start)
        allowed &= token in set(tokens)
        guide.advance(token)
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "times": times, "allowed": allowed, "forced": None}


def _outlines_vocabulary(tokenizer: Any) -> Any:
    """outlines-core's `Vocabulary` of a Hugging Face tokenizer: each token's text (byte-level BPE decoded, as
    outlines' own tokenizer adapter gives it)."""
    import outlines_core

    eos = tokenizer.eos_token_id
    tokens: dict[str, list[int]] = {}
    for text, index in tokenizer.get_vocab().items():
        if index != eos:
            tokens.setdefault(tokenizer.convert_tokens_to_string([text]), []).append(index)
    return outlines_core.Vocabulary(eos, tokens)


ENGINES: dict[str, Callable[[Any, list[int], int], dict[str, object]]] = {
    "llguidance": _llguidance,
    "xgrammar": _xgrammar,
    "outlines-core": _outlines_core,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--reps", type=int, default=5, help="walks of the output per engine (the median is kept)")
    parser.add_argument("--engines", default=",".join(ENGINES))
    args = parser.parse_args()
    print(cpu_line())
    loaded = load_model(args.model, dtype="float32")
    tokenizer, vocab = loaded.tokenizer, int(loaded.model.get_input_embeddings().weight.shape[0])
    ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    print(f"model {args.model}: vocabulary {vocab}; the output is {len(ids)} tokens\n")
    print("| engine | version | licence | tokenizer s | compile ms | mask us/token (median) | max us | allowed |")
    print("|---|---|---|---|---|---|---|---|")

    for name in args.engines.split(","):
        package = name.replace("-", "_")
        try:
            version = metadata.version(package)
            meta = metadata.metadata(package)
            licence = meta.get("License-Expression") or meta.get("License") or "?"
            runs = [ENGINES[name](tokenizer, ids, vocab) for _ in range(args.reps)]
        except Exception as exc:  # an engine that is not installed or fails: say so, keep the others' rows
            print(f"| {name} | - | - | - | - | - | - | failed: {type(exc).__name__}: {str(exc)[:80]} |")
            continue
        per_token = [statistics.median(r["times"]) * 1e6 for r in runs]  # type: ignore[arg-type]
        worst = max(max(r["times"]) for r in runs) * 1e6  # type: ignore[type-var]
        compile_ms = statistics.median(float(r["compile_s"]) * 1e3 for r in runs)  # type: ignore[arg-type]
        tok_s = statistics.median(float(r["tokenizer_s"]) for r in runs)  # type: ignore[arg-type]
        ok = all(r["allowed"] for r in runs)
        print(
            f"| {name} | {version} | {licence} | {tok_s:.2f} | {compile_ms:.1f} | {statistics.median(per_token):.0f} "
            f"| {worst:.0f} | {'yes' if ok else 'NO'} |"
        )
        if runs[0]["forced"] is not None:
            forced = list(runs[0]["forced"])  # type: ignore[call-overload]
            print(f"|   forced at the start | {len(forced)} tokens: {tokenizer.decode(forced)!r} | | | | | | |")


if __name__ == "__main__":
    main()
