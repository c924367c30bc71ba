"""The concurrency sweep of ``lattice bench --engine ...``: 1, 4, 16 clients against ``lattice serve``.

For each engine a real ``lattice serve --engine E`` process is started (as a user would), then for each client
count ``c``, ``c`` threads send the same ``requests`` non-streaming ``/v1/completions`` calls (prompts as token
ids, greedy, a fixed budget) as fast as answers come back. Reported per level: aggregate tokens/s (completion
tokens of all requests over the level's wall time) and p50/p95 request latency, with any time this process was
stopped by someone else (`PauseClock`) left out.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lattice_inference.errors import LatticeError

#: vLLM's first start compiles its model (minutes on a small shared CPU); later starts reuse the compile cache.
START_TIMEOUT_S = 1200.0


@dataclass
class Level:
    """One client count's figures."""

    clients: int
    requests: int
    tokens: int
    wall_s: float
    p50_s: float
    p95_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"tokens_per_s": self.tokens_per_s}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linearly interpolated (0.0 for none)."""
    if not values:
        return 0.0
    if len(values) == 1:
        return float(values[0])
    return statistics.quantiles(sorted(values), n=100, method="inclusive")[round(q * 100) - 1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A ``lattice serve`` child process on a free loopback port, its log in a temporary file."""

    def __init__(self, serve_args: Sequence[str]) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="lattice-sweep-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "lattice_inference.cli", "serve", *serve_args, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = Path(self.log.name).read_text(errors="replace")[-2000:]
                raise LatticeError(f"lattice serve exited with status {self.proc.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise LatticeError(f"lattice serve did not answer /health within {timeout:.0f} s (log: {self.log.name})")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class PauseClock:
    """Wall time with the pauses of this process taken out. On a shared machine other jobs may stop niced
    processes (SIGSTOP) while they measure, and the server and its clients are stopped together; a ticking thread
    sees each stop as a gap of more than ``threshold`` seconds, and `active` leaves those gaps out."""

    def __init__(self, tick: float = 0.05, threshold: float = 1.0) -> None:
        self.gaps: list[tuple[float, float]] = []
        self._tick, self._threshold = tick, threshold
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        last = time.perf_counter()
        while True:
            time.sleep(self._tick)
            now = time.perf_counter()
            if now - last > self._threshold:
                self.gaps.append((last + self._tick, now))
            last = now

    def active(self, t0: float, t1: float) -> float:
        """Seconds from ``t0`` to ``t1`` (perf_counter) minus the gaps inside them."""
        return (t1 - t0) - sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in self.gaps)

    def paused(self) -> float:
        return sum(b - a for a, b in self.gaps)


CLOCK: PauseClock | None = None


def _elapsed(t0: float) -> float:
    t1 = time.perf_counter()
    return CLOCK.active(t0, t1) if CLOCK is not None else t1 - t0


def complete(base: str, model: str, prompt: Sequence[int], max_tokens: int) -> tuple[int, float]:
    """One greedy ``/v1/completions`` call; (completion tokens, seconds, pauses left out)."""
    body = json.dumps({"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0})
    request = urllib.request.Request(
        f"{base}/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=3600) as r:
        answer = json.loads(r.read())
    return int(answer["usage"]["completion_tokens"]), _elapsed(t0)


def run_level(
    base: str, model: str, prompts: Sequence[Sequence[int]], clients: int, requests: int, max_tokens: int
) -> Level:
    """``requests`` calls (prompts in turn) from ``clients`` concurrent clients."""
    jobs = [prompts[i % len(prompts)] for i in range(requests)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(lambda p: complete(base, model, p, max_tokens), jobs))
    wall = _elapsed(t0)
    latencies = [s for _, s in done]
    return Level(
        clients, requests, sum(t for t, _ in done), wall, percentile(latencies, 0.5), percentile(latencies, 0.95)
    )


def sweep(
    label: str,
    serve_args: Sequence[str],
    model: str,
    prompts: Sequence[Sequence[int]],
    levels: Sequence[int],
    requests: int,
    max_tokens: int,
    progress: Callable[[str], None] | None = None,
) -> list[Level]:
    """Start ``lattice serve serve_args`` (``label`` names it in progress lines), warm it up with one request,
    run every level (``requests`` calls each, at least one per client), stop it."""
    global CLOCK
    CLOCK = CLOCK or PauseClock()
    server = Server(serve_args)
    try:
        server.wait_ready()
        complete(server.base, model, prompts[0], min(16, max_tokens))
        out = []
        for clients in levels:
            out.append(run_level(server.base, model, prompts, clients, max(requests, clients), max_tokens))
            if progress:
                lv = out[-1]
                progress(
                    f"{label}: {clients} clients, {lv.tokens_per_s:.1f} tok/s, p50 {lv.p50_s:.2f} s, p95 "
                    f"{lv.p95_s:.2f} s ({CLOCK.paused():.0f} s of pauses left out so far)"
                )
        return out
    finally:
        server.close()
