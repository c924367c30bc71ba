"""This side of the vLLM worker: send it runs of (options, prompts) and read back what vLLM generated.

Each run is one vLLM engine (a ``speculative_config`` is fixed per engine, so greedy and ngram are two runs) in
a worker process of its own. vLLM's log goes to our stderr, so stdout stays the output.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lattice_inference.engines.vllm.mapping import (
    check_sampling,
    engine_argv,
    mtp_layers_of,
    sampling_params,
    speculative_config,
)
from lattice_inference.engines.vllm.runtime import VllmModel, VllmRuntime, child_env
from lattice_inference.errors import LatticeError
from lattice_inference.options import DecodeOptions
from lattice_inference.sampling import SamplingOptions

WORKER = Path(__file__).with_name("worker.py")


@dataclass(frozen=True)
class VllmRequest:
    """One prompt (token ids) with its budget and sampling."""

    prompt_ids: Sequence[int]
    max_new_tokens: int
    sampling: SamplingOptions = field(default_factory=SamplingOptions)


@dataclass(frozen=True)
class VllmRun:
    """Requests for one engine built from ``options`` (its method and draft settings); ``together`` sends them
    as one batch, otherwise one at a time (batch 1, each timed); ``warmup`` runs a short request first."""

    options: DecodeOptions
    requests: Sequence[VllmRequest]
    together: bool = False
    warmup: bool = False


@dataclass(frozen=True)
class VllmOutput:
    """What vLLM generated for one request: ids (EOS excluded, as the local engine reports them), text, stop
    reason (``eos``/``length``/vLLM's own), wall seconds of its ``generate`` call and its draft counters."""

    token_ids: list[int]
    text: str
    stop_reason: str
    seconds: float
    prompt_tokens: int
    spec: dict[str, int]

    @classmethod
    def from_worker(cls, row: dict[str, Any], eos_token_ids: Sequence[int]) -> VllmOutput:
        ids = [int(t) for t in row["token_ids"]]
        if ids and ids[-1] in eos_token_ids:
            ids = ids[:-1]
        reason = {"stop": "eos", "length": "length"}.get(row["finish_reason"], str(row["finish_reason"]))
        return cls(ids, row["text"], reason, float(row["seconds"]), int(row["prompt_tokens"]), dict(row["spec"]))


def run_argv(model: VllmModel, options: DecodeOptions, engine_args: str = "") -> list[str]:
    """The engine flags of one run: the model folder, its dtype, the mapped ``speculative_config``, the user's
    ``--engine-args``."""
    spec = speculative_config(options, mtp_layers_of(model.config))
    return engine_argv(model.location, model.dtype, spec, engine_args)


def job_of(model: VllmModel, runs: Sequence[VllmRun], engine_args: str = "", cpu_build: bool = False) -> dict:
    """The worker's JOB.json for ``runs`` (every option mapped, or `ConfigError` before vLLM starts;
    ``cpu_build``: vLLM's CPU build, which cannot sample under speculation)."""
    for run in runs:
        for r in run.requests:
            check_sampling(run.options.method, r.sampling, cpu_build)
    return {
        "runs": [
            {
                "argv": run_argv(model, run.options, engine_args),
                "together": run.together,
                "warmup": run.warmup,
                "requests": [
                    {
                        "prompt_token_ids": [int(t) for t in r.prompt_ids],
                        "sampling": sampling_params(r.sampling, r.max_new_tokens),
                    }
                    for r in run.requests
                ],
            }
            for run in runs
        ]
    }


def run_job(
    runtime: VllmRuntime, job: dict[str, Any], *, threads: int | None = None, quiet: bool = True
) -> dict[str, Any]:
    """Run a worker JOB (`job_of`'s shape) in ``runtime``'s interpreter; the worker's RESULT. Each run gets a
    worker process of its own: vLLM 0.32's CPU build re-registers its kernel overrides when a second engine
    starts in one process, and sampling under speculation then reads uninitialised memory."""
    runs = []
    for run in job["runs"]:
        runs += _run_worker(runtime, {"runs": [run]}, threads, quiet)["runs"]
    return {"runs": runs}


def _run_worker(runtime: VllmRuntime, job: dict[str, Any], threads: int | None, quiet: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="lattice-vllm-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        env = child_env(runtime, threads, quiet=quiet)
        done = subprocess.run(
            [runtime.python, str(WORKER), str(job_path), str(result_path)], env=env, stdout=sys.stderr, check=False
        )
        if done.returncode != 0 or not result_path.is_file():
            raise LatticeError(f"vLLM ({runtime.python}) failed with exit status {done.returncode}; its log is above")
        return json.loads(result_path.read_text())


def outputs_of(result: dict[str, Any], eos_token_ids: Sequence[int]) -> list[list[VllmOutput]]:
    """The worker's RESULT as one list of `VllmOutput` per run, in request order."""
    return [[VllmOutput.from_worker(row, eos_token_ids) for row in run["outputs"]] for run in result["runs"]]


def run_batch(
    runtime: VllmRuntime,
    model: VllmModel,
    runs: Sequence[VllmRun],
    eos_token_ids: Sequence[int],
    *,
    engine_args: str = "",
    threads: int | None = None,
    quiet: bool = True,
) -> list[list[VllmOutput]]:
    """Run ``runs`` through vLLM in ``runtime``'s interpreter; one list of outputs per run, in request order."""
    result = run_job(runtime, job_of(model, runs, engine_args, runtime.cpu), threads=threads, quiet=quiet)
    return outputs_of(result, eos_token_ids)
