import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

# Spin-waiting OpenMP threads slow everything down on a small shared machine; must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

import pytest  # noqa: E402  (after the environment set-up above)

from .serve_harness import greedy, load_tiny  # noqa: E402


@pytest.fixture(scope="module")
def loaded():
    """The tiny served model (`serve_harness.load_tiny`), once per module; modules on another model define their own."""
    return load_tiny()


@pytest.fixture(scope="module")
def reference(loaded):
    """Plain greedy decoding over ``loaded``: what every served method must reproduce."""
    return greedy(loaded)


@pytest.fixture(scope="module")
def quant_ops():
    """The native build's quantized products (`native_ops.quant`); the test skips where they do not run here."""
    from lattice_inference.kernels import native_ops

    built = native_ops.quant()
    if built is None:
        pytest.skip(f"our products do not run here ({native_ops.unavailable() or 'no AVX2 with FMA'})")
    return built


@pytest.fixture(scope="session")
def smollm2():
    """The real default model in float32 (``load_model("smollm2", dtype="float32")``), loaded once per session for
    the modules on it (they skip where it is absent). Generators pack its weights, as every target does; tests must
    not change it otherwise."""
    from lattice_inference.models.load import load_model

    return load_model("smollm2", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_generators(smollm2):
    """Over `smollm2`, built once per session: ``greedy`` (plain decoding) and ``ngram`` (prompt lookup with every
    proposal verified, ``adaptive=False``), the settings several modules test; each generation starts from scratch
    (only a generation's cached prompt rows and a generator's compiled grammars outlive it, and neither changes
    what it emits)."""
    from lattice_inference import Generator

    eos = smollm2.eos_token_ids
    return {
        "greedy": Generator(smollm2.model, smollm2.tokenizer, method="greedy", eos_token_ids=eos),
        "ngram": Generator(smollm2.model, smollm2.tokenizer, method="ngram", adaptive=False, eos_token_ids=eos),
    }


@pytest.fixture(scope="session")
def smollm2_plain(smollm2_generators):
    """Plain decoding on `smollm2` (its ``greedy`` generator) as `helpers.Memo`: each reference computed once per
    session, whichever module asks first."""
    from .helpers import Memo

    return Memo(smollm2_generators["greedy"])


@pytest.fixture(scope="session")
def smollm2_dequantized():
    """``load_model("smollm2", dtype="float32")`` with the GGUF cache off (``LATTICE_GGUF_CACHE=0``): the file
    dequantized anew by transformers (what `gguf_dequantized.load_gguf` returns uncached, on the CPU, in eval mode),
    the slowest load there is, once per session. Compared with, never changed: copy it (``copy.deepcopy``) to change
    it."""
    from lattice_inference.models.load import load_model

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LATTICE_GGUF_CACHE", "0")
        return load_model("smollm2", dtype="float32")


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """``tiny_gguf(fmt)``: the small random-weight llama GGUF file in ``fmt`` that ``bench/bench_quant_sizes.py``
    writes (``tiny-{fmt}.gguf``: the ``tiny`` shape, ``tiny256`` for the K-quant mix ``Q4_K_M``; the real default
    model's metadata, so only where it is installed), written once per session; tests read it, never change it."""
    from lattice_inference.models.source import smollm2_gguf

    from .helpers import bench_module

    folder = tmp_path_factory.mktemp("tiny-gguf")
    written: dict[str, Path] = {}

    def file(fmt: str) -> Path:
        if fmt not in written:
            path = folder / f"tiny-{fmt}.gguf"
            shape = "tiny256" if fmt == "Q4_K_M" else "tiny"
            bench_module("bench_quant_sizes").write_gguf(path, shape, fmt, Path(smollm2_gguf()))
            written[fmt] = path
        return written[fmt]

    return file


OTHER_BUILDS = {
    "avx2": (("-mno-avx512f",), ("quant_linear", "rows_linear")),
    "avx512-without-vnni": (("-mno-avx512vnni",), ("quant_linear",)),
}
"""Builds of the native products for other CPUs (name: compiler flags, sources), which tests compare with this one."""


@pytest.fixture(scope="session")
def other_builds():
    """The `OTHER_BUILDS` compiled once per session, side by side (each compile is mostly torch's headers): name ->
    the module, binding ``quant_linear``/``quant_linear_kernel`` (and ``rows_pack``/``rows_linear``/
    ``rows_linear_kernel`` where built)."""
    from torch.utils import cpp_extension

    from lattice_inference.kernels import native_ops

    binds = {
        "quant_linear": 'm.def("quant_linear", &quant_linear); m.def("quant_linear_kernel", &quant_linear_kernel);',
        "rows_linear": 'm.def("rows_pack", &rows_pack); m.def("rows_linear", &rows_linear); '
        'm.def("rows_linear_kernel", &rows_linear_kernel);',
    }
    with tempfile.TemporaryDirectory() as root:

        def build(name: str) -> ModuleType:
            flags, sources = OTHER_BUILDS[name]
            directory = Path(root) / name
            directory.mkdir()
            bind = directory / "bind.cpp"
            includes = "".join(f'#include "{source}.h"\n' for source in sources)
            body = " ".join(binds[source] for source in sources)
            bind.write_text(f"{includes}PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{ {body} }}\n")
            return cpp_extension.load(
                name="lattice_other_" + name.replace("-", "_"),
                sources=[str(bind), *(str(native_ops.CSRC / f"{source}.cpp") for source in sources)],
                extra_cflags=[*native_ops.FLAGS, *flags],
                extra_include_paths=[str(native_ops.CSRC)],
                build_directory=str(directory),
            )

        with ThreadPoolExecutor(len(OTHER_BUILDS)) as pool:
            futures = {name: pool.submit(build, name) for name in OTHER_BUILDS}
            yield {name: future.result() for name, future in futures.items()}
