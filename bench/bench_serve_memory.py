"""Server memory over many requests that cycle through speculation settings, prompts and lengths.

Starts ``lattice serve`` (its own process, as a user would) and sends ``--requests`` completions, request ``i``
with setting ``i % --settings`` (ngram with ``max_draft`` 2, 3, ... and mtp with ``draft_length`` 2, 3, ...: each
its own generator, and many verification widths), prompts and lengths varying (many attention lengths). The
server's RSS (``/proc/PID/status`` ``VmRSS``) is read after the warm-up (the first ``--warmup`` requests) and after
every request; the report gives the warm-up level, the largest and the last reading and their growth over it.

Run: ``python bench/bench_serve_memory.py`` (bundled model, 500 requests, 12 settings, 128 tokens each; Linux).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import openai
from bench_serve import free_port, start_server

#: Environment variables that change the server's memory, echoed with the command.
ENVIRONMENT = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_")

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "The quick brown fox",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "Once upon a time",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bundled", help="what `lattice serve --model` takes (default: bundled)")
    p.add_argument("--requests", type=int, default=500, help="requests in all (default 500)")
    p.add_argument("--settings", type=int, default=12, help="distinct speculation settings cycled, 2..14 (default 12)")
    p.add_argument("--warmup", type=int, default=48, help="requests before the reference reading (default 48)")
    p.add_argument("--max-tokens", type=int, default=128, help="largest max_tokens of a request (default 128)")
    p.add_argument("--threads", type=int, default=2, help="the server's torch threads (default 2)")
    p.add_argument("--dtype", default="auto", help="the server's weights dtype (default: the checkpoint's)")
    p.add_argument("--draft-length", type=int, default=4, help="the server's default mtp draft length")
    return p.parse_args()


def setting(i: int, count: int) -> dict[str, object]:
    """The ``speculative`` object of setting ``i`` (of ``count``): half ngram, half mtp, each a distinct length."""
    k = i % count
    if k % 2 == 0:
        return {"method": "ngram", "max_draft": 2 + k // 2}
    return {"method": "mtp", "draft_length": 2 + k // 2}


def rss_mb(pid: int) -> float:
    """Resident set size of process ``pid`` in MB (Linux)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS line")


def main() -> None:
    args = parse_args()
    env = [f"{k}={os.environ[k]}" for k in ENVIRONMENT if k in os.environ]  # the allocators' settings, where given
    print("$ " + shlex.join([*env, sys.executable, *sys.argv]), flush=True)
    port = free_port()
    server = start_server(args, port)
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    model = api.models.list().data[0].id
    readings: list[float] = []
    base = 0.0
    start = time.perf_counter()
    try:
        for i in range(args.requests):
            api.completions.create(
                model=model,
                prompt=PROMPTS[i % len(PROMPTS)],
                max_tokens=args.max_tokens // 2 + (i * 37) % (args.max_tokens // 2 + 1),
                temperature=0,
                extra_body={"speculative": setting(i, args.settings)},
            )
            if i + 1 == args.warmup:
                base = rss_mb(server.pid)
            elif i + 1 > args.warmup:
                readings.append(rss_mb(server.pid))
            if (i + 1) % 50 == 0:
                print(f"{i + 1} requests, RSS {rss_mb(server.pid):.1f} MB", flush=True)
    finally:
        server.terminate()
        server.wait()
    seconds = time.perf_counter() - start
    print(
        f"{args.requests} requests over {args.settings} settings in {seconds:.0f}s: RSS after {args.warmup} requests "
        f"{base:.1f} MB; largest after {max(readings):.1f} MB (+{max(readings) - base:.1f}); last {readings[-1]:.1f} "
        f"MB (+{readings[-1] - base:.1f})"
    )


if __name__ == "__main__":
    main()
