"""Server overhead: time to first token and tokens/s per method, through `lattice serve` vs the Python API.

Both sides run the same model (same dtype, same torch threads) on the same prompts with the same method and
``max_tokens``; only one of them works at any moment. The server runs in its own process (``lattice serve``,
as a user would start it); the client is the real ``openai`` client streaming ``/v1/completions``.

- ``TTFT``: from the call (``gen.stream_tokens(...)``, decoded as it streams, / ``completions.create(stream=True)``)
  to the first text.
- ``tok/s``: completion tokens / wall time from the call to the last text (prefill included), over all prompts.
- ``server/API``: the ratio within one pass, the sides taking turns prompt by prompt (paired, so slow drifts of
  this shared machine cancel); reported:
  the median over ``--reps`` passes, next to the median absolute figures. Every pass also checks that the server's
  text equals the API's.

Prompts are sent as token ids (``/v1/completions`` takes them), encoded once here, so both sides see the same
input; conversations of the prompt set go through the chat template.

Run: ``.venv/bin/python bench/bench_serve.py`` (bundled model, its held-out prompts cut to ``--prompts 8``,
3 passes); ``--model smollm2`` (or a folder / GGUF file) with ``--methods greedy,ngram``, ``--json FILE`` to
save everything.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

# Other processes share this machine's cores: spin-waiting OpenMP threads would make both sides crawl.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import openai
import torch

from lattice_inference import benchmark
from lattice_inference.api import Generator, mtp_head_for, needs_mtp_head
from lattice_inference.cli import quiet_transformers
from lattice_inference.models.load import load_model
from lattice_inference.models.source import resolve_model
from lattice_inference.streaming import TextStream


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bundled", help="what `lattice serve --model` takes (default: bundled)")
    p.add_argument("--methods", default="greedy,ngram,mtp,ngram+mtp", help="comma-separated methods")
    p.add_argument("--prompts", type=int, default=8, help="how many of the model's bench prompts (default 8)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per prompt (default 128)")
    p.add_argument("--reps", type=int, default=3, help="timed passes after a warm-up (default 3)")
    p.add_argument("--threads", type=int, default=2, help="torch threads on both sides (default 2)")
    p.add_argument("--dtype", default="auto", help="weights dtype on both sides (default: the checkpoint's)")
    p.add_argument("--draft-length", type=int, default=2, help="mtp: tokens per round (default 2, as lattice bench)")
    p.add_argument("--json", help="write the per-pass figures to this file")
    return p.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "lattice_inference.cli", "serve", "--model", args.model, "--port", str(port),
        "--threads", str(args.threads), "--dtype", args.dtype, "--draft-length", str(args.draft_length),
        "--log-level", "warning",
    ]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return server
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start") from None
            time.sleep(0.2)


def time_api(gen: Generator, prompt: list[int], max_tokens: int) -> tuple[str, float, float, int]:
    """(text, TTFT, total seconds, tokens) of one streamed generation through the Python API."""
    start = time.perf_counter()
    text = TextStream(gen.tokenizer)
    first, pieces, tokens = 0.0, [], 0
    for chunk in gen.stream_tokens(prompt, max_tokens):
        tokens += len(chunk)
        piece = text.push(chunk)
        if piece and not pieces:
            first = time.perf_counter() - start
        if piece:
            pieces.append(piece)
    pieces.append(text.flush())
    return "".join(pieces), first, time.perf_counter() - start, tokens


def time_server(
    api: openai.OpenAI, model: str, method: str, prompt: list[int], max_tokens: int
) -> tuple[str, float, float, int]:
    """(text, TTFT, total seconds, tokens) of one streamed completion through the server."""
    start = time.perf_counter()
    stream = api.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
        extra_body={"speculative": {"method": method}},
    )  # fmt: skip
    first, pieces, tokens, end = 0.0, [], 0, 0.0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            if not pieces:
                first = time.perf_counter() - start
            pieces.append(chunk.choices[0].text)
            end = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return "".join(pieces), first, end, tokens


def one_pass(runs: dict, prompts: list[list[int]], max_tokens: int) -> dict[str, dict]:
    """Per side: median TTFT, tokens/s over all prompts, and the texts. The sides take turns prompt by prompt
    (alternating which goes first), so load from other processes hits both alike."""
    ttfts: dict[str, list[float]] = {side: [] for side in runs}
    wall = dict.fromkeys(runs, 0.0)
    tokens = dict.fromkeys(runs, 0)
    texts: dict[str, list[str]] = {side: [] for side in runs}
    for i, prompt in enumerate(prompts):
        for side in list(runs)[:: 1 if i % 2 == 0 else -1]:
            text, ttft, seconds, n = runs[side](prompt, max_tokens)
            ttfts[side].append(ttft)
            wall[side] += seconds
            tokens[side] += n
            texts[side].append(text)
    return {
        side: {"ttft_ms": 1000 * statistics.median(ttfts[side]), "tok_s": tokens[side] / wall[side], "texts": text}
        for side, text in texts.items()
    }


def main() -> None:
    args = parse_args()
    quiet_transformers()
    torch.set_num_threads(args.threads)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    rows = benchmark.load_prompts(benchmark.default_prompts_path(resolve_model(args.model)))[: args.prompts]
    loaded = load_model(args.model, dtype=args.dtype)
    head = mtp_head_for(loaded, args.draft_length) if any(map(needs_mtp_head, methods)) else None
    gens = {
        m: Generator(loaded.model, loaded.tokenizer, method=m, draft_length=args.draft_length, mtp_head=head,
                     eos_token_ids=loaded.eos_token_ids)
        for m in methods
    }  # fmt: skip
    # Token ids on both sides: conversations go through the chat template here, once, and identically.
    prompts = [benchmark.encode_prompt(gens[methods[0]], r) for r in rows]
    port = free_port()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the server
    server = start_server(args, port)
    try:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        model = api.models.list().data[0].id
        passes: dict[str, list] = {m: [] for m in methods}
        for rep in range(args.reps + 1):  # pass 0 warms both sides up
            for m in methods:
                runs = {
                    "api": lambda p, n, m=m: time_api(gens[m], p, n),
                    "server": lambda p, n, m=m: time_server(api, model, m, p, n),
                }
                result = one_pass(runs, prompts if rep else prompts[:1], args.max_tokens)
                if rep:
                    passes[m].append(result)
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"$ {shlex.join(sys.argv)}")
    print(f"model {loaded.source} ({str(next(loaded.model.parameters()).dtype).removeprefix('torch.')}), "
          f"{len(prompts)} prompts x {args.max_tokens} tokens, {args.reps} passes, {args.threads} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")  # fmt: skip
    print(
        "| method | API TTFT ms | server TTFT ms | TTFT server/API | API tok/s | server tok/s | tok/s server/API "
        "| same text |"
    )
    print("|---|---|---|---|---|---|---|---|")
    report = {}
    for m, ps in passes.items():
        med = lambda f, ps=ps: statistics.median(f(p) for p in ps)  # noqa: E731
        same = all(p["api"]["texts"] == p["server"]["texts"] for p in ps)
        row = {
            "api_ttft_ms": med(lambda p: p["api"]["ttft_ms"]),
            "server_ttft_ms": med(lambda p: p["server"]["ttft_ms"]),
            "ttft_ratio": med(lambda p: p["server"]["ttft_ms"] / p["api"]["ttft_ms"]),
            "api_tok_s": med(lambda p: p["api"]["tok_s"]),
            "server_tok_s": med(lambda p: p["server"]["tok_s"]),
            "tok_s_ratio": med(lambda p: p["server"]["tok_s"] / p["api"]["tok_s"]),
            "same_text": same,
            "passes": [{side: {k: v for k, v in p[side].items() if k != "texts"} for side in p} for p in ps],
        }
        report[m] = row
        print(f"| {m} | {row['api_ttft_ms']:.1f} | {row['server_ttft_ms']:.1f} | {row['ttft_ratio']:.2f} | "
              f"{row['api_tok_s']:.0f} | {row['server_tok_s']:.0f} | {row['tok_s_ratio']:.2f} | "
              f"{'yes' if same else 'NO'} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"command": sys.argv, "methods": report}, indent=1))


if __name__ == "__main__":
    main()
