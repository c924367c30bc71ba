import os

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
