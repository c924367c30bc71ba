"""Code edits with the original file as OpenAI's ``prediction``: `lattice serve` with and without it, beside
llama.cpp's `llama-server` with its best n-gram drafting (which takes no prediction), on the same GGUF file.

Each edit asks for a whole file back with one change (a rename, a signature change, a docstring added) to a file
no one here wrote (the first ``--lines`` lines of a standard-library module). Ours runs every edit as whole
(non-streamed) greedy requests: ``greedy`` and ``ngram`` without a prediction, ``ngram`` and ``greedy`` with the
original file as the prediction, and ``ngram`` with an unrelated file as the prediction (what a wrong prediction
costs); llama-server runs it with ``--spec-type ngram-mod``. Each request is a new edit: ours runs with
``--no-prefix-cache`` (the variants of one edit share its prompt, which would otherwise be computed once for all).
Each row (seconds, tokens, decode time, the prediction's accepted and refused tokens, the text) is appended to
``--out`` the moment it is measured; the summary gives each variant's whole-request time over the edits and its
ratio to ours without a prediction.

    python bench/bench_prediction.py --gguf qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \\
        --llama-server /path/llama.cpp/build/bin/llama-server --out bench/prediction_rows.jsonl
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_long_session import Rows, peer_parser
from bench_serve_concurrency import Server, cpu_line, free_port, send, start, stop

HOST = "127.0.0.1"
EDITS = (
    ("textwrap", "Rename the class TextWrapper to LineWrapper everywhere (its uses included)."),
    ("shlex", "Make the arguments of split after s keyword-only (add *, before comments), keeping its body."),
    ("colorsys", "Add a one-line docstring to every function that has none."),
)
UNRELATED = "fnmatch"
"""The module whose file is sent as the wrong prediction."""
VARIANTS = (
    ("greedy", None),
    ("ngram", None),
    ("ngram", "original"),
    ("greedy", "original"),
    ("ngram", "unrelated"),
)


def source(module: str, lines: int) -> str:
    """The first ``lines`` lines of a standard-library module."""
    path = Path(os.__file__).parent / f"{module}.py"
    return "".join(path.read_text().splitlines(keepends=True)[:lines])


MODEL = {"id": "m"}
"""The model id the running server lists (`start` returns it)."""


def body(instruction: str, text: str, method: str | None, prediction: str | None, args: argparse.Namespace) -> dict:
    """One whole greedy chat request for the edit (``method``: ours's speculation method; None: the server's)."""
    ask = f"{instruction} Output the whole edited file in one ```python block, nothing else.\n\n```python\n{text}```"
    out: dict[str, Any] = {
        "model": MODEL["id"],
        "messages": [{"role": "user", "content": ask}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
    }
    if method is not None:
        out["speculative"] = {"method": method}
    if prediction is not None:
        out["prediction"] = {"type": "content", "content": prediction}
    return out


def run_edits(port: int, engine: str, variants: tuple[tuple[str | None, str | None], ...], args, rows: Rows) -> None:
    url = f"http://{HOST}:{port}/v1/chat/completions"
    for module, instruction in EDITS:
        text = source(module, args.lines)
        wrong = source(UNRELATED, args.lines)
        for method, predicted in variants:
            prediction = {"original": text, "unrelated": wrong, None: None}[predicted]
            began = time.perf_counter()
            answer, error = send(url, body(instruction, text, method, prediction, args), args.timeout)
            seconds = time.perf_counter() - began
            if error is not None:
                rows.add(engine=engine, module=module, method=method, prediction=predicted, error=error)
                continue
            usage = answer.get("usage") or {}
            details = usage.get("completion_tokens_details") or {}
            metrics = answer.get("speculative_metrics") or {}
            rows.add(
                engine=engine, module=module, method=method, prediction=predicted, seconds=round(seconds, 3),
                prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"),
                decode_s=metrics.get("decode_s"), prefill_s=metrics.get("prefill_s"),
                accepted_prediction_tokens=details.get("accepted_prediction_tokens"),
                rejected_prediction_tokens=details.get("rejected_prediction_tokens"),
                text=answer["choices"][0]["message"]["content"],
            )  # fmt: skip


def summary(path: Path, date: str) -> str:
    """Each variant's whole-request seconds summed over the edits (today's rows in ``path``), beside ours without a
    prediction; decode tokens per second; the prediction's tokens accepted and refused."""
    import json

    found = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in found if r.get("date") == date and "seconds" in r]
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["engine"], str(r["method"]), str(r["prediction"])), []).append(r)
    total = {k: sum(r["seconds"] for r in v) for k, v in groups.items()}
    greedy, ngram = total.get(("ours", "greedy", "None")), total.get(("ours", "ngram", "None"))
    lines = ["| engine | method | prediction | whole requests (s) | vs our greedy | vs our ngram | decode tok/s | "
             "prediction accepted / refused |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for (engine, method, prediction), value in total.items():
        got = groups[(engine, method, prediction)]
        decode = sum(r.get("decode_s") or 0 for r in got)
        tokens = sum(r.get("completion_tokens") or 0 for r in got)
        accepted = sum(r.get("accepted_prediction_tokens") or 0 for r in got)
        refused = sum(r.get("rejected_prediction_tokens") or 0 for r in got)
        lines.append(
            f"| {engine} | {method} | {prediction} | {value:.1f} | {greedy / value if greedy else 0:.2f}x | "
            f"{ngram / value if ngram else 0:.2f}x | {tokens / decode if decode else 0:.1f} | {accepted} / {refused} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = peer_parser(__doc__, "bench/prediction_rows.jsonl")
    parser.add_argument("--lines", type=int, default=120, help="lines of each module sent (and asked back)")
    parser.add_argument("--max-tokens", type=int, default=1500)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    base = {
        "date": time.strftime("%Y-%m-%d"), "cpu": cpu_line(), "machine": platform.machine(),
        "threads": args.threads, "gguf": Path(args.gguf).name, "scenario": "prediction",
    }  # fmt: skip
    rows = Rows(Path(args.out), base)
    print(f"# {base['cpu']}, {args.threads} threads, {base['gguf']}", flush=True)
    ours = [
        sys.executable, "-m", "lattice_inference.cli", "serve", "--model", args.gguf, "--host", HOST, "--port",
        "{port}", "--threads", str(args.threads), "--log-level", "warning", "--no-prefix-cache",
    ]  # fmt: skip
    binary = Path(args.llama_server)
    llama = [
        str(binary), "-m", args.gguf, "-t", str(args.threads), "-tb", str(args.threads), "-c", "8192", "-np", "1",
        "--host", HOST, "--port", "{port}", "--spec-type", "ngram-mod",
    ]  # fmt: skip
    engines = {
        "ours": (Server(ours), VARIANTS),
        "llama-server": (Server(llama, dict(os.environ, LD_LIBRARY_PATH=str(binary.parent))), ((None, None),)),
    }
    for engine in args.engines.split(","):
        server, variants = engines[engine]
        port = free_port()
        try:
            MODEL["id"] = start(server, port, Path(args.out).with_suffix(f".{engine}.log"), timeout=600)
            run_edits(port, engine, variants, args, rows)
        except Exception as exc:  # the rows so far are written; say what failed and go on
            rows.add(engine=engine, error=repr(exc)[:300])
        finally:
            stop(server)
    print(summary(Path(args.out), base["date"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
