"""Loading a Hugging Face-format model directory (or hub id) with errors a user can act on."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from lattice_inference.errors import ConfigError, ModelLoadError

DTYPES = {"auto": "auto", "bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer, and the EOS ids its generation config declares."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: tuple[int, ...]
    source: str


def eos_token_ids_of(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """EOS ids from the generation config, falling back to the model config, then the tokenizer."""
    for value in (
        getattr(model.generation_config, "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
        tokenizer.eos_token_id,
    ):
        if value is None:
            continue
        ids = value if isinstance(value, list | tuple) else [value]
        return tuple(int(i) for i in ids)
    return ()


def _check_local_dir(path: Path) -> None:
    if not path.is_dir():
        raise ModelLoadError(f"model path '{path}' is not a directory")
    config = path / "config.json"
    if not config.is_file():
        raise ModelLoadError(f"model directory '{path}' has no config.json: is it a Hugging Face model directory?")
    try:
        json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read '{config}': {exc}") from exc
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ModelLoadError(f"model directory '{path}' has no weight files (*.safetensors)")


def load_model(model: str | Path, dtype: str = "auto", device: str = "cpu") -> LoadedModel:
    """Load a causal LM and its tokenizer from a local directory, or a hub id where there is internet.

    ``dtype`` is ``auto`` (the checkpoint's own), ``bfloat16``, ``float32`` or ``float16``.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    source = str(model)
    path = Path(source).expanduser()
    looks_local = path.exists() or source.startswith((".", "/", "~")) or source.count("/") != 1
    if looks_local:
        if not path.exists():
            raise ModelLoadError(f"model directory '{source}' does not exist")
        _check_local_dir(path)
        source = str(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        lm = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[dtype])
    except (OSError, ValueError, KeyError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot load model '{source}': {first_line}") from exc
    lm = lm.to(device).eval()
    return LoadedModel(model=lm, tokenizer=tokenizer, eos_token_ids=eos_token_ids_of(lm, tokenizer), source=source)
