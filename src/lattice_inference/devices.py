"""Where a model runs: ``--device auto|cpu|cuda|cuda:N`` (``device=`` in the Python API), resolved once, at load,
with errors a user can act on.

``auto`` is the first CUDA device where torch sees one, else the CPU. Asking for CUDA names what is missing: a
CPU build of torch, no visible GPU, an index past the last device; a model that does not fit names its size and
the device's free memory before a byte is copied (`check_fits`).
"""

from __future__ import annotations

import re

import torch

from lattice_inference.errors import ConfigError, ModelLoadError

__all__ = [
    "DEVICE_CHOICES",
    "DEVICE_HELP",
    "WEIGHTS",
    "check_fits",
    "describe_device",
    "device_map",
    "placement",
    "resolve_device",
]

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
DEVICE_HELP = (
    "where the model runs: auto (the first CUDA GPU where torch sees one, else the CPU), cpu, cuda or cuda:N "
    "(default auto)"
)
_CUDA = re.compile(r"cuda(?::(\d+))?")


def resolve_device(spec: str | torch.device | None = "auto") -> torch.device:
    """The device ``spec`` names (None or ``"auto"``: the first CUDA device where there is one, else the CPU).

    Raises `ConfigError` with one line naming what is missing: an unknown spelling, a torch built without CUDA,
    no visible CUDA device, or an index past the last one.
    """
    if isinstance(spec, torch.device):
        spec = str(spec)
    text = "auto" if spec is None else spec.strip().lower()
    if text == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    match = _CUDA.fullmatch(text)
    if match is None:
        raise ConfigError(f"unknown device {spec!r}; choose {DEVICE_CHOICES}", param="device")
    if torch.version.cuda is None:
        raise ConfigError(
            f"device {spec!r}: this torch ({torch.__version__}) is built without CUDA; install a CUDA build of "
            "torch, or run with --device cpu",
            param="device",
        )
    count = torch.cuda.device_count()
    if count == 0:
        raise ConfigError(
            f"device {spec!r}: torch sees no CUDA device (no driver, or CUDA_VISIBLE_DEVICES hides them all)",
            param="device",
        )
    index = int(match.group(1) or 0)
    if index >= count:
        raise ConfigError(
            f"device {spec!r}: no such device; torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}",
            param="device",
        )
    return torch.device("cuda", index)


def device_map(device: torch.device | None) -> dict[str, object]:
    """``from_pretrained`` keywords that load the weights straight onto ``device`` (none for the CPU: its default)."""
    return {} if device is None or device.type == "cpu" else {"device_map": {"": str(device)}}


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def check_fits(nbytes: int, device: torch.device, free: int | None = None) -> None:
    """Fail with one line when ``nbytes`` of weights cannot fit in ``device``'s free memory.

    Only CUDA devices are checked (a CPU swaps rather than fails); ``free`` defaults to what
    ``torch.cuda.mem_get_info`` reports. The weights need room for the KV cache and activations beside them,
    so the check asks for the weights' size plus a tenth.
    """
    if device.type != "cuda":
        return
    if free is None:
        free = torch.cuda.mem_get_info(device)[0]
    if nbytes * 1.1 > free:
        raise ModelLoadError(
            f"the model does not fit on {device}: its weights take {_gib(nbytes)}, the device has {_gib(free)} free"
        )


def describe_device(device: torch.device) -> str:
    """The device as metrics and ``--json`` name it: ``cuda:0 (NVIDIA H200)`` or ``cpu``."""
    if device.type == "cuda":
        index = device.index if device.index is not None else 0
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(device)


WEIGHTS = "lattice_weights"
"""Attribute of a model whose linear weights are not in its dtype (a GGUF file's kept quantized: ``"GGUF Q4_1+Q8_0"``,
set by `lattice_inference.models.gguf_quantized`), which `placement` reports as ``weights``."""


def first_weight(model: torch.nn.Module) -> torch.Tensor:
    """``model``'s first parameter that holds data, whose device and dtype are the model's: a model loaded from a
    GGUF file as stored (`models.gguf_quantized`) has placeholders on the meta device where its quantized layers'
    dense weights would be, and its embedding is no parameter."""
    for weight in model.parameters():
        if weight.device.type != "meta":
            return weight
    raise ValueError(f"{type(model).__name__} has no parameter holding data")


def placement(model: torch.nn.Module) -> dict[str, str]:
    """Where ``model``'s weights are and what they are, as ``--json``, bench reports and server metrics say it:
    ``{"device": "cuda:0 (NVIDIA H200)", "dtype": "bfloat16"}``, and ``"weights": "GGUF Q4_1+Q8_0"`` where its linear
    layers run on a GGUF file's quantized blocks (`WEIGHTS`)."""
    weight = first_weight(model)
    found = {"device": describe_device(weight.device), "dtype": str(weight.dtype).removeprefix("torch.")}
    weights = getattr(model, WEIGHTS, None)
    return found | {"weights": weights} if isinstance(weights, str) else found
