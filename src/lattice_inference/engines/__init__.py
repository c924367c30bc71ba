"""Engines: who runs the model behind ``lattice generate``, ``lattice bench`` and ``lattice serve``.

``local`` (the default) is this package's own speculative decoder in this process. ``vllm`` hands the same
options to vLLM (`lattice_inference.engines.vllm`), which runs in its own interpreter: vLLM pins torch and
transformers versions of its own, so it usually lives in a separate virtual environment, and this side talks
to it through a child process (batch generation) or its own OpenAI-compatible server (``serve``).
"""

from __future__ import annotations

import argparse

from lattice_inference.errors import ConfigError

ENGINES = ("local", "vllm")
DEFAULT_ENGINE = "local"


def parse_engines(text: str, *, several: bool = False) -> list[str]:
    """The engines named by ``--engine`` (``local``, ``vllm``, or with ``several`` a comma-separated list);
    `ConfigError` naming an unknown one."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if not names or unknown:
        raise ConfigError(f"unknown engine {', '.join(unknown) or repr(text)}; choose from {', '.join(ENGINES)}")
    if len(names) > 1 and not several:
        raise ConfigError(f"--engine takes one engine here, got {text!r}")
    return list(dict.fromkeys(names))


def add_engine_arguments(parser: argparse.ArgumentParser, *, several: bool = False) -> None:
    """``--engine``, ``--vllm-python`` and ``--engine-args``: the options every sub-command shares; with
    ``several`` (``lattice bench``), the comparison's concurrency sweep options too."""
    what = "comma-separated engines to compare" if several else "who runs the model"
    parser.add_argument(
        "--engine", default=DEFAULT_ENGINE, help=f"{what}: local (this package, default) or vllm (vLLM's engine)"
    )
    parser.add_argument(
        "--vllm-python",
        help="vllm: the Python interpreter that has vLLM installed, e.g. its venv's bin/python (default: "
        "$LATTICE_VLLM_PYTHON, else this interpreter)",
    )
    parser.add_argument(
        "--engine-args",
        default="",
        help="vllm: more vLLM engine flags, passed through as written (--engine-args='--tensor-parallel-size 2')",
    )
    if several:
        group = parser.add_argument_group("engine comparison (--engine local,vllm)")
        group.add_argument(
            "--sweep", default="1,4,16", help="client counts of the concurrency sweep through lattice serve ('0': none)"
        )
        group.add_argument("--sweep-requests", type=int, default=16, help="requests per client count (default 16)")
        group.add_argument("--sweep-method", default="ngram", help="the method both servers run (default ngram)")
        group.add_argument("--sweep-only", action="store_true", help="skip the batch-1 part")
