"""llama.cpp (through ``llama-cpp-python`` 0.3.36) as a bench peer: a subprocess worker for the peers venv.

It runs in a venv of its own (no torch; its Python given to ``bench_peers.py`` with ``--peers-python`` or the
``LATTICE_PEERS_PYTHON`` environment variable) so that llama.cpp's OpenMP and ours never share a process;
``bench_peers.py`` calls it as

    $LATTICE_PEERS_PYTHON bench/peer_llamacpp.py --gguf FILE --requests REQ.json --out OUT.json \
        [--reps N] [--threads 2]

``REQ.json``: ``{"max_new_tokens": N, "methods": {"llama.cpp": null, "llama.cpp lookup 10": 10, ...},
"prompts": [[ids...], ...]}`` (a method's value is ``LlamaPromptLookupDecoding``'s ``num_pred_tokens``, or
null for plain decoding; an optional ``"eos_token_ids"`` defaults to ``[2]``, SmolLM2's ``<|im_end|>``).
``OUT.json``: ``{"method": [{"prompt": i, "rep": r, "token_ids": [...], "seconds": s}, ...]}``.

Each request is greedy (``temp=0``: llama.cpp's greedy sampler, an argmax), decoded from token ids with the
low-level ``Llama.generate`` loop (no detokenizing, no string stops), and stops at an EOS id (not included in
``token_ids``) or after ``max_new_tokens``. ``seconds`` is the wall time of the whole request, prompt processing
included. The model is loaded once per method (the draft model is a constructor argument), one warm-up request
runs before timing, and the state is reset before every request, so each one evaluates its whole prompt (no
prefix reuse between requests). With a draft model ``logits_all=True`` is required: without it 0.3.36 crashes
once the context passes 512 positions.

``peers_python()`` finds that interpreter and ``llamacpp_available()`` checks it from any venv (it imports nothing
from llama_cpp), saying how to build it where it is missing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PEERS_PYTHON_ENV = "LATTICE_PEERS_PYTHON"
"""Environment variable naming the peers venv's Python (``--peers-python`` takes precedence)."""
BUILD_COMMANDS = """\
python3 -m venv ~/.venvs/peers
~/.venvs/peers/bin/pip install scikit-build-core cmake ninja numpy typing-extensions diskcache jinja2
PATH=~/.venvs/peers/bin:$PATH CMAKE_BUILD_PARALLEL_LEVEL=2 \\
  CMAKE_ARGS="-DPython_EXECUTABLE=$HOME/.venvs/peers/bin/python" \\
  ~/.venvs/peers/bin/pip install --no-build-isolation llama-cpp-python==0.3.36   # ~5 min on 2 cores
export LATTICE_PEERS_PYTHON=~/.venvs/peers/bin/python   # or pass --peers-python"""
DEFAULT_EOS = (2,)


def peers_python(given: str | None = None) -> Path | None:
    """The peers venv's Python: ``given`` (``--peers-python``), else ``$LATTICE_PEERS_PYTHON``, else None."""
    path = given or os.environ.get(PEERS_PYTHON_ENV)
    return Path(path).expanduser() if path else None


def llamacpp_available(python: Path | None) -> str | None:
    """None if ``python`` (the peers venv) can import ``llama_cpp``, else a message with the build commands."""
    if python is None:
        why = f"no --peers-python or ${PEERS_PYTHON_ENV} given"
        return f"llama.cpp peer unavailable: {why}. Build it with:\n{BUILD_COMMANDS}"
    if not python.exists():
        return f"llama.cpp peer unavailable: {python} not found. Build it with:\n{BUILD_COMMANDS}"
    try:
        res = subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"llama.cpp peer unavailable: {python} failed ({exc}). Build it with:\n{BUILD_COMMANDS}"
    if res.returncode == 0:
        return None
    why = (res.stderr.strip().splitlines() or ["import failed"])[-1]
    return f"llama.cpp peer unavailable: {python} cannot import llama_cpp ({why}). Build it with:\n{BUILD_COMMANDS}"


def load_llama(gguf: str, lookup: int | None, threads: int, n_ctx: int):  # -> llama_cpp.Llama
    """A ``Llama`` on ``gguf``, with ``LlamaPromptLookupDecoding(num_pred_tokens=lookup)`` as draft if given."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
    return Llama(
        model_path=gguf,
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=n_ctx,
        seed=1234,
        logits_all=draft is not None,
        draft_model=draft,
        verbose=False,
    )


def generate(llm, prompt: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """Greedy token ids after ``prompt`` (its whole prompt evaluated afresh), without the final EOS."""
    llm.reset()  # n_tokens = 0: no prefix reuse; eval() then drops the stale KV cells
    out: list[int] = []
    if max_new_tokens <= 0:
        return out
    gen = llm.generate(prompt, temp=0.0, repeat_penalty=1.0)
    try:
        for token in gen:
            if token in eos:
                break
            out.append(int(token))
            if len(out) >= max_new_tokens:
                break
    finally:
        gen.close()
    return out


def run_method(
    gguf: str, lookup: int | None, prompts: list[list[int]], max_new: int, reps: int, threads: int, eos: set[int]
) -> list[dict]:
    """Load once, one warm-up request, then ``reps`` timed passes over ``prompts``."""
    n_ctx = max(4096, max(map(len, prompts)) + max_new + 32)
    llm = load_llama(gguf, lookup, threads, n_ctx)
    try:
        generate(llm, prompts[0], max_new, eos)  # warm-up (not timed)
        rows = []
        for rep in range(reps):
            for i, prompt in enumerate(prompts):
                t0 = time.perf_counter()
                ids = generate(llm, prompt, max_new, eos)
                seconds = time.perf_counter() - t0
                rows.append({"prompt": i, "rep": rep, "token_ids": ids, "seconds": seconds})
        return rows
    finally:
        llm.close()
        del llm
        gc.collect()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: read the requests, run every method, write the results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True, help="GGUF file of the model")
    ap.add_argument("--requests", required=True, help="REQ.json (max_new_tokens, methods, prompts)")
    ap.add_argument("--out", required=True, help="where to write OUT.json")
    ap.add_argument("--reps", type=int, default=1, help="timed passes over the prompts (default 1)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads, batch and decode (default 2)")
    args = ap.parse_args(argv)
    req = json.loads(Path(args.requests).read_text())
    prompts = [[int(t) for t in p] for p in req["prompts"]]
    if not prompts:
        ap.error("no prompts in the requests file")
    max_new = int(req["max_new_tokens"])
    eos = {int(t) for t in req.get("eos_token_ids", DEFAULT_EOS)}
    results: dict[str, list[dict]] = {}
    for name, lookup in req["methods"].items():
        t0 = time.perf_counter()
        results[name] = run_method(args.gguf, lookup, prompts, max_new, args.reps, args.threads, eos)
        n_tok = sum(len(r["token_ids"]) for r in results[name])
        secs = sum(r["seconds"] for r in results[name])
        print(
            f"[peer_llamacpp] {name}: {n_tok} tokens in {secs:.2f} s timed ({n_tok / secs:.1f} tok/s), "
            f"{time.perf_counter() - t0:.1f} s with load and warm-up",
            file=sys.stderr,
        )
    Path(args.out).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
