"""Long prompts through two servers side by side: `lattice serve` at its defaults against llama.cpp's `llama-server`
(its defaults: prompt cache on), on the same GGUF file, over documents no one here wrote (standard-library modules).

Three scenarios, each row appended to ``--out`` (JSON lines) the moment it is measured, so a failure loses none:

* ``session``: an agent session over one long document: ``--turns`` turns, each resending the conversation so far
  (the document, every earlier question and answer) plus a new question, streamed, greedy; per turn the time to the
  first streamed token and to the end, and the whole session's time. ``llama-server`` runs 1 slot (``-np 1``).
* ``gap``: a stream's worst gap while a long prompt arrives: client A streams a long answer to a short prompt; once
  it has streamed ``--gap-after`` chunks, client B sends a ``--gap-tokens``-token document; A's gaps between
  streamed chunks after B arrived (median and worst) and B's first token. ``llama-server`` runs 2 slots.
* ``whole``: whole grounded requests over documents of ``--whole-tokens`` tokens (a different module each, so
  nothing is reused between them), one request each, ``--max-tokens`` new tokens.

Documents are cut at a number of characters (``CHARS_PER_TOKEN``); the prompt token counts the servers report are
recorded. The answer texts are recorded too: greedy, ours is plain decoding's token for token (the tests prove it);
llama.cpp's kernels round otherwise, so its text may differ.

    python bench/bench_long_session.py --gguf qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \\
        --llama-server /path/llama.cpp/build/bin/llama-server --out bench/long_session_rows.jsonl
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools

from bench_serve_concurrency import Server, cpu_line, free_port, start, stop

HOST = "127.0.0.1"
CHARS_PER_TOKEN = 4.9
"""Characters of a standard-library module per Qwen2.5 token (measured: argparse.py's first 47,600 characters,
9,713 prompt tokens with the chat template)."""
MODULES = ("argparse", "typing", "inspect", "doctest", "tarfile", "subprocess", "difflib", "ast", "dataclasses")
QUESTIONS = (
    "Summarise what this module does in three sentences.",
    "List the names of the classes it defines, one per line.",
    "Quote the signature of the first function it defines, exactly as written.",
    "Which modules does it import? Answer with their names only.",
    "Which class has the most methods? Name it and say why it needs them.",
    "Quote the module's first comment line exactly.",
)


def document(module: str, tokens: int) -> str:
    """The first ``tokens`` tokens (by `CHARS_PER_TOKEN`) of a standard-library module's source."""
    path = Path(os.__file__).parent / f"{module}.py"
    return path.read_text()[: int(tokens * CHARS_PER_TOKEN)]


MODEL = {"id": "m"}
"""The model id the running server lists (`start` returns it)."""


def stream_chat(port: int, messages: list[dict[str, str]], max_tokens: int, timeout: float) -> Iterator[Any]:
    """POST a streamed chat completion; yields ``(seconds since sent, event)`` for each SSE event."""
    body = {
        "model": MODEL["id"],
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    sent = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        yield time.perf_counter() - sent, json.loads(data)
    conn.close()


def chat(port: int, messages: list[dict[str, str]], max_tokens: int, timeout: float) -> dict[str, Any]:
    """One streamed chat completion: its text, the arrival time of each chunk with text, prompt tokens."""
    text, arrivals, prompt_tokens, cached = [], [], None, None
    for at, event in stream_chat(port, messages, max_tokens, timeout):
        for choice in event.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                text.append(piece)
                arrivals.append(at)
        usage = event.get("usage")
        if usage:
            prompt_tokens = usage.get("prompt_tokens")
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"text": "".join(text), "arrivals": arrivals, "prompt_tokens": prompt_tokens, "cached": cached}


class Rows:
    """Rows appended to a JSON-lines file as they come (see the module docstring)."""

    def __init__(self, path: Path, base: dict[str, Any]) -> None:
        self.path, self.base = path, base

    def add(self, **row: Any) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(self.base | row) + "\n")
        shown = {k: v for k, v in row.items() if k not in ("text", "arrivals")}
        print(json.dumps(shown), flush=True)


def session(port: int, engine: str, args: argparse.Namespace, rows: Rows) -> None:
    doc = document(MODULES[0], args.session_tokens)
    messages = [{"role": "user", "content": f"Here is a Python module:\n\n```python\n{doc}\n```\n\n{QUESTIONS[0]}"}]
    whole = time.perf_counter()
    for turn in range(args.turns):
        if turn:
            messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        began = time.perf_counter()
        out = chat(port, messages, args.max_tokens, args.timeout)
        seconds = time.perf_counter() - began
        first = out["arrivals"][0] if out["arrivals"] else seconds
        rows.add(
            scenario="session", engine=engine, turn=turn + 1, first_token_s=round(first, 3), seconds=round(seconds, 3),
            prompt_tokens=out["prompt_tokens"], cached=out["cached"], chunks=len(out["arrivals"]), text=out["text"],
        )  # fmt: skip
        messages.append({"role": "assistant", "content": out["text"]})
    rows.add(scenario="session", engine=engine, turn="all", seconds=round(time.perf_counter() - whole, 3))


def gap(port: int, engine: str, args: argparse.Namespace, rows: Rows) -> None:
    streamed: list[float] = []
    arrived = threading.Event()
    b_out: dict[str, Any] = {}
    b_sent: list[float] = []

    def second() -> None:
        arrived.wait()
        b_sent.append(time.perf_counter())
        doc = document(MODULES[1], args.gap_tokens)
        content = f"Here is a Python module:\n\n```python\n{doc}\n```\n\n{QUESTIONS[0]}"
        b_out.update(chat(port, [{"role": "user", "content": content}], 16, args.timeout))

    helper = threading.Thread(target=second)
    helper.start()
    ask = [{"role": "user", "content": "Write a numbered list of 150 fruits, one per line, with a short note each."}]
    began = time.perf_counter()
    for at, event in stream_chat(port, ask, args.gap_stream_tokens, args.timeout):
        if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
            streamed.append(began + at)
            if len(streamed) == args.gap_after:
                arrived.set()
    arrived.set()
    helper.join()
    if not b_sent:
        raise RuntimeError("the long prompt was never sent")
    gaps = [b - a for a, b in itertools.pairwise(streamed)]
    before = [g for g, t in zip(gaps, streamed[1:], strict=False) if t <= b_sent[0]]
    after = [g for g, t in zip(gaps, streamed[1:], strict=False) if t > b_sent[0]]
    b_first = b_out["arrivals"][0] if b_out.get("arrivals") else None
    rows.add(
        scenario="gap", engine=engine, chunks=len(streamed), median_gap_s=round(statistics.median(gaps), 4),
        median_gap_before_s=round(statistics.median(before), 4) if before else None,
        worst_gap_after_s=round(max(after), 3) if after else None, b_prompt_tokens=b_out.get("prompt_tokens"),
        b_first_token_s=round(b_first, 3) if b_first else None,
        a_ended_before_b=not after,
    )  # fmt: skip


def whole(port: int, engine: str, args: argparse.Namespace, rows: Rows) -> None:
    for i, tokens in enumerate(int(t) for t in args.whole_tokens.split(",")):
        doc = document(MODULES[2 + i % (len(MODULES) - 2)], tokens)
        content = f"Here is a Python module:\n\n```python\n{doc}\n```\n\n{QUESTIONS[2]}"
        began = time.perf_counter()
        out = chat(port, [{"role": "user", "content": content}], args.max_tokens, args.timeout)
        seconds = time.perf_counter() - began
        first = out["arrivals"][0] if out["arrivals"] else seconds
        rows.add(
            scenario="whole", engine=engine, tokens=tokens, prompt_tokens=out["prompt_tokens"],
            first_token_s=round(first, 3), seconds=round(seconds, 3), chunks=len(out["arrivals"]), text=out["text"],
        )  # fmt: skip


def servers(args: argparse.Namespace, slots: int) -> dict[str, Server]:
    ours = [
        sys.executable, "-m", "lattice_inference.cli", "serve", "--model", args.gguf, "--host", HOST, "--port",
        "{port}", "--threads", str(args.threads), "--log-level", "warning", *args.ours_args.split(),
    ]  # fmt: skip
    binary = Path(args.llama_server)
    env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent))
    llama = [
        str(binary), "-m", args.gguf, "-t", str(args.threads), "-tb", str(args.threads), "-c", str(args.ctx),
        "-np", str(slots), "--host", HOST, "--port", "{port}", *args.llama_args.split(),
    ]  # fmt: skip
    found = {"ours": Server(ours), "llama-server": Server(llama, env)}
    return {name: found[name] for name in args.engines.split(",")}


SCENARIOS = {"session": (session, 1), "gap": (gap, 2), "whole": (whole, 1)}


def peer_parser(doc: str | None, out: str) -> argparse.ArgumentParser:
    """The arguments a bench beside llama-server takes: the GGUF file, llama-server's binary, the rows' file, the
    engines and the threads (its description: ``doc``'s first paragraph)."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--llama-server", default="llama-server", help="llama.cpp's binary (its libraries beside it)")
    parser.add_argument("--out", default=out)
    parser.add_argument("--engines", default="ours,llama-server")
    parser.add_argument("--threads", type=int, default=2)
    return parser


def main() -> int:
    parser = peer_parser(__doc__, "bench/long_session_rows.jsonl")
    parser.add_argument("--scenarios", default="session,gap,whole")
    parser.add_argument("--ctx", type=int, default=32768, help="llama-server's -c (its context over every slot)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--session-tokens", type=int, default=14000)
    parser.add_argument("--gap-tokens", type=int, default=7000)
    parser.add_argument("--gap-after", type=int, default=8, help="A's streamed chunks before B arrives")
    parser.add_argument("--gap-stream-tokens", type=int, default=400)
    parser.add_argument("--whole-tokens", default="2000,4000,8000,16000")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--ours-args", default="", help="extra `lattice serve` flags (default: none, its defaults)")
    parser.add_argument("--llama-args", default="--spec-type ngram-mod", help="extra llama-server flags")
    args = parser.parse_args()
    base = {
        "date": time.strftime("%Y-%m-%d"), "cpu": cpu_line(), "machine": platform.machine(),
        "threads": args.threads, "gguf": Path(args.gguf).name,
    }  # fmt: skip
    rows = Rows(Path(args.out), base)
    print(f"# {base['cpu']}, {args.threads} threads, {base['gguf']}", flush=True)
    for name in args.scenarios.split(","):
        run, slots = SCENARIOS[name]
        for engine, server in servers(args, slots).items():
            port = free_port()
            log = Path(args.out).with_suffix(f".{engine}.log")
            try:
                MODEL["id"] = start(server, port, log, timeout=600)
                run(port, engine, args, rows)
            except Exception as exc:  # the rows so far are written; say what failed and go on
                rows.add(scenario=name, engine=engine, error=repr(exc)[:300])
            finally:
                stop(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
