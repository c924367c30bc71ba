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
    from lattice_inference.targets import native_ops

    built = native_ops.quant()
    if built is None:
        pytest.skip(f"our products do not run here ({native_ops.unavailable() or 'no AVX2 with FMA'})")
    return built


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

    from lattice_inference.targets import native_ops

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
