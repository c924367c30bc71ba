"""``--device``/``device=``: resolving a device spelling, the errors for a CUDA device that is not there, the fit
check, dtype ``auto`` on a GPU, and the device named where results are reported (the native ops' own checks are
in test_native_ops). CUDA itself is not needed: torch's view of CUDA is patched where a test is about it."""

from __future__ import annotations

import pytest
import torch

from lattice_inference import devices
from lattice_inference.devices import check_fits, first_weight, placement, resolve_device
from lattice_inference.errors import ConfigError, ModelLoadError
from lattice_inference.models.load import _check_local_dir, load_model, torch_dtype
from lattice_inference.models.source import resolve_model
from lattice_testing.toy import save_toy_model_dir, toy_config, toy_model


@pytest.fixture
def gpus(monkeypatch):
    """Pretend torch is a CUDA build that sees ``n`` GPUs (call the fixture's result with n)."""

    def see(n: int) -> None:
        monkeypatch.setattr(torch.version, "cuda", "13.0")
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)

    return see


def test_cpu_and_auto_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device(None) == resolve_device(" CPU ") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_auto_and_cuda_pick_the_first_gpu_and_indices_are_checked(gpus):
    gpus(2)
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"device 'cuda:2': no such device; torch sees 2 CUDA device\(s\), cuda:0"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:-1", "cuda:x", "mps", ""])
def test_unknown_spellings_name_the_choices(spec):
    with pytest.raises(ConfigError, match="choose auto, cpu, cuda or cuda:N") as info:
        resolve_device(spec)
    assert info.value.param == "device"


def test_cuda_on_a_cpu_build_or_without_a_visible_gpu_says_which(monkeypatch, gpus):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ConfigError, match=r"device 'cuda': this torch \(.*\) is built without CUDA; .*--device cpu"):
        resolve_device("cuda")
    gpus(0)
    with pytest.raises(ConfigError, match="torch sees no CUDA device"):
        resolve_device("cuda:0")
    assert resolve_device("auto") == torch.device("cpu")


def test_a_model_too_big_for_the_device_names_both_sizes():
    cuda = torch.device("cuda", 0)
    with pytest.raises(ModelLoadError, match=r"does not fit on cuda:0: its weights take 2.00 GiB, .* 1.50 GiB free"):
        check_fits(2 * 2**30, cuda, free=3 * 2**29)
    check_fits(2**30, cuda, free=2 * 2**30)
    check_fits(2**40, torch.device("cpu"), free=0)  # a CPU is not checked: it swaps rather than fails


def test_load_refuses_a_cuda_device_it_cannot_use_before_reading_the_model(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ConfigError, match="built without CUDA"):
        load_model("/nonexistent/model", device="cuda")  # the device is checked first: no 'does not exist'


def test_dtype_auto_is_bfloat16_on_a_gpu_and_the_checkpoints_own_on_a_cpu(tmp_path):
    folder = save_toy_model_dir(tmp_path / "m", "llama", seed=0)
    source = resolve_model(str(folder))
    assert torch_dtype("auto", source, torch.device("cuda", 0)) is torch.bfloat16
    assert torch_dtype("auto", source, "cpu") == "auto"
    assert torch_dtype("float16", source, "cuda:0") is torch.float16
    with pytest.raises(ConfigError, match="unknown dtype 'half'"):
        torch_dtype("half", source)


def test_the_fit_check_counts_the_checkpoints_weights(tmp_path):
    """The element count read from the safetensors headers (before loading) is the model's parameter count, so
    a CUDA load checks the weights' real size in the dtype asked for."""
    folder = save_toy_model_dir(tmp_path / "m", "qwen3", seed=0)
    model = load_model(str(folder), dtype="float32", device="cpu").model
    assert _check_local_dir(folder) == sum(p.numel() for p in model.parameters())


def test_placement_names_device_and_dtype(monkeypatch):
    model = toy_model(toy_config("llama"), seed=0).to(torch.bfloat16)
    assert placement(model) == {"device": "cpu", "dtype": "bfloat16"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"GPU {index}")
    assert devices.describe_device(torch.device("cuda", 1)) == "cuda:1 (GPU 1)"


def test_first_weight_skips_the_placeholders_a_gguf_load_as_stored_leaves():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, device="meta"), torch.nn.Linear(4, 4, dtype=torch.float64))
    assert first_weight(model) is model[1].weight  # the first parameter is a dropped dense weight (meta)
    assert placement(model)["dtype"] == "float64"
    with pytest.raises(ValueError, match="no parameter holding data"):
        first_weight(torch.nn.Linear(2, 2, device="meta"))
