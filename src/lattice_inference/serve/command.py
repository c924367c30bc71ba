"""The ``lattice serve`` sub-command: parse its options, load the model once, run uvicorn."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from lattice_inference.flags import (
    MODEL_HELP,
    add_decode_arguments,
    add_placement_arguments,
    decode_options,
    positive_int,
)
from lattice_inference.models.source import served_name
from lattice_inference.options import (
    MAX_BATCH,
    SHUTDOWN_TIMEOUT,
    SUFFIX_SCOPES,
    check_max_batch,
    check_shutdown_timeout,
)

if TYPE_CHECKING:
    from lattice_inference.options import DecodeOptions
    from lattice_inference.serve.engine import Engine

DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUE = 16
DEFAULT_MAX_BODY = 4 * 1024 * 1024


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``serve`` to the ``lattice`` command's sub-parsers, with the decoding flags ``generate`` has (their
    values are the server's defaults, which a request's ``speculative`` and sampling fields override)."""
    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    serve.add_argument("--model", help=MODEL_HELP)
    serve.add_argument(
        "--served-model-name", help="the model id clients send (default: --model's name, or its file/folder name)"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    serve.add_argument(
        "--api-key",
        action="append",
        help="require 'Authorization: Bearer KEY' on every route but /health (or LATTICE_API_KEY, keys separated by "
        "commas); repeat for several keys, each its own tenant of the suffix methods",
    )
    serve.add_argument(
        "--suffix-scope",
        choices=SUFFIX_SCOPES,
        default=SUFFIX_SCOPES[0],
        help="suffix: which requests draft from each other: tenant (default: same API key and speculative.scope), "
        "shared (every request: only where all clients may see each other's text) or request (none)",
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help="requests that may wait behind the running one; beyond: 429",
    )
    serve.add_argument(
        "--max-batch",
        type=positive_int,
        default=MAX_BATCH,
        help=f"generations running at once, their rounds sharing each forward (continuous batching; each answer "
        f"stays what it is alone); 1: one at a time (default {MAX_BATCH})",
    )
    serve.add_argument("--max-body", type=positive_int, default=DEFAULT_MAX_BODY, help="request body limit, bytes")
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=SHUTDOWN_TIMEOUT,
        help=f"on SIGTERM/SIGINT: seconds running generations may finish before they are ended (default "
        f"{SHUTDOWN_TIMEOUT:g})",
    )
    serve.add_argument(
        "--no-webui", action="store_true", help="serve no chat page at / (the API only; default: the page at /)"
    )
    add_decode_arguments(serve)
    add_placement_arguments(serve)
    serve.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's choice)")
    serve.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    from lattice_inference.engines import add_engine_arguments

    add_engine_arguments(serve)


def default_options(args: argparse.Namespace) -> DecodeOptions:
    """The server's default decoding settings (`ConfigError` for a bad one, before anything loads)."""
    return decode_options(args)


def build_engine(args: argparse.Namespace) -> Engine:
    """Load the model once and wrap it in an `Engine` with the command's default speculation settings."""
    from lattice_inference.models.load import load_model
    from lattice_inference.serve.engine import Engine, cap_onednn_cache

    cap_onednn_cache()  # before the first forward, when oneDNN reads it
    settings = default_options(args)
    name = args.served_model_name or served_name(args.model)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    return Engine(loaded, settings, name=name, mtp_head_path=args.mtp_head, suffix_scope=args.suffix_scope)


def _load(args: argparse.Namespace) -> tuple[Engine, float]:
    """The engine, its self-check run and its forward costs measured (off the first request); returns it and the
    seconds the checks took."""
    from lattice_inference.batching import Batch

    engine = build_engine(args)
    decoder = engine.generator(engine.defaults).decoder
    seconds = decoder.prepare()
    if args.max_batch > 1:
        seconds += Batch(decoder.target).prepare(decoder)
    return engine, seconds


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; returns the exit code."""
    from lattice_inference.errors import ConfigError

    try:
        from lattice_inference.serve.app import create_app
        from lattice_inference.serve.shutdown import serve
    except ImportError as exc:
        raise ConfigError(f"lattice serve needs its extra: pip install 'lattice-inference[serve]' ({exc})") from None
    from lattice_inference.engines import parse_engines
    from lattice_inference.process import run_on_passing_thread, settle_after_load

    if parse_engines(args.engine) != ["local"]:
        return _serve_vllm(args)
    import torch

    options = default_options(args)
    check_shutdown_timeout(args.shutdown_timeout)
    if args.max_queue < 0:
        raise ConfigError(f"--max-queue must be non-negative, got {args.max_queue}")
    check_max_batch(args.max_batch, "--max-batch")
    if 0 < options.kv_slots < args.max_batch:  # before loading: every running request holds a cache slot
        raise ConfigError(f"--kv-slots ({options.kv_slots}) must be at least --max-batch ({args.max_batch})")
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be 1..65535, got {args.port}")
    if args.threads:
        torch.set_num_threads(args.threads)
    engine, seconds = run_on_passing_thread(lambda: _load(args))  # see `lattice_inference.process`
    settle_after_load()
    decoder = engine.generator(engine.defaults).decoder
    if decoder.exactness is not None:
        print(f"lattice serve: {decoder.exactness.line()} ({seconds:.1f}s at start)", flush=True)
    prefix = getattr(decoder.target, "prefix_memory", None)
    if prefix is not None and getattr(decoder.target, "prefix_cache", False):
        print(f"lattice serve: {prefix.line()}", flush=True)
    api_key = args.api_key or [k for k in os.environ.get("LATTICE_API_KEY", "").split(",") if k] or None
    app = create_app(
        engine,
        api_key=api_key,
        max_queue=args.max_queue,
        max_body=args.max_body,
        max_batch=args.max_batch,
        shutdown_timeout=args.shutdown_timeout,
        webui=not args.no_webui,
    )
    where = app.state.server.metrics.info
    print(
        f"lattice serve: {engine.name} ({args.method}, {where['dtype']} on {where['device']}, up to "
        f"{args.max_batch} at once) on http://{args.host}:{args.port}/v1"
        + ("" if args.no_webui else f"; chat page: http://{args.host}:{args.port}/"),
        flush=True,
    )
    serve(app, host=args.host, port=args.port, log_level=args.log_level, shutdown_timeout=args.shutdown_timeout)
    print("lattice serve: shut down", flush=True)
    return 0


def _serve_vllm(args: argparse.Namespace) -> int:
    """``--engine vllm``: vLLM's own OpenAI server with the mapped options (`lattice_inference.engines.vllm`)."""
    from lattice_inference.engines.vllm.server import serve

    options = default_options(args)
    args.served_model_name = args.served_model_name or served_name(args.model)
    return serve(args, {"max_queue": DEFAULT_MAX_QUEUE, "max_body": DEFAULT_MAX_BODY}, options)
