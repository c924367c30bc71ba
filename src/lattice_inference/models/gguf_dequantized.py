"""GGUF checkpoints: dequantized through transformers' GGUF support, with a local cache of the result.

transformers reads a GGUF file's metadata several times while loading it (config, tokenizer, weights), which
costs many times what loading the same weights as safetensors does (bench/RESULTS.md). So the first
load of a GGUF file in a given dtype writes the dequantized model and its tokenizer as a Hugging Face folder
under the cache folder (`cache.cache_root`), keyed by the file's name, size and modification time; later loads read
that folder. The cached weights are exactly what dequantization produced, so outputs do not change.
``LATTICE_GGUF_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from lattice_inference.cache_dir import cache_root
from lattice_inference.devices import device_map
from lattice_inference.errors import ModelLoadError
from lattice_inference.process import release_freed_memory

GGUF_MAGIC = b"GGUF"


def cache_enabled() -> bool:
    """False when ``LATTICE_GGUF_CACHE`` is ``0``/``false``/``no``."""
    return os.environ.get("LATTICE_GGUF_CACHE", "1").strip().lower() not in {"0", "false", "no", "off"}


def check_gguf_file(path: Path) -> None:
    """Fail with a one-line error unless ``path`` starts with the GGUF magic bytes."""
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file '{path}': {exc.strerror or exc}") from exc
    if head != GGUF_MAGIC:
        raise ModelLoadError(f"'{path}' is not a GGUF file (it does not start with the bytes 'GGUF')")


def _cache_key(path: Path) -> str:
    """The file's name, size and modification time: what the cached folders made from it are named by."""
    st = path.stat()
    return f"{path.stem}-{st.st_size}-{st.st_mtime_ns}"


def _cache_dir(path: Path, what: torch.dtype | str) -> Path:
    """The cached folder of ``path``'s model dequantized to a dtype, or of another ``what`` made from it."""
    name = str(what).removeprefix("torch.")
    return cache_root() / "gguf" / f"{_cache_key(path)}-{name}"


def config_and_tokenizer(path: Path) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    """The Hugging Face config and tokenizer of the GGUF file ``path``, from the cache when they were read before:
    transformers parses the file's metadata (its vocabulary and merges) anew for each, seconds every time."""
    # v2: merges written as strings (`_save_folder`); folders of the first form are not read
    cached = _cache_dir(path, "config-v2") if cache_enabled() else None
    if cached is not None and (cached / "config.json").is_file():
        try:
            return AutoConfig.from_pretrained(cached), saved_tokenizer(cached)
        except Exception:  # a damaged cache entry: read the file again
            shutil.rmtree(cached, ignore_errors=True)
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # gguf and transformers raise many types for bad files; all are the user's file
        raise load_error(path, exc) from exc
    if cached is not None:
        _write_atomically(cached, lambda tmp: _save_folder(tokenizer, tmp, config))
        if (cached / "tokenizer.json").is_file():  # the same tokenizer as every later load, without the lists
            del tokenizer
            return config, saved_tokenizer(cached)
    return config, tokenizer


def _save_folder(tokenizer: PreTrainedTokenizerBase, folder: Path, beside: PretrainedConfig | PreTrainedModel) -> None:
    """``beside.save_pretrained(folder)`` (the config, or the whole model) and ``tokenizer.save_pretrained(folder)``,
    its BPE merges then written as ``"a b"`` strings where no merged token holds a space (byte-level and
    SentencePiece vocabularies hold none): the same merges, which the tokenizers library reads with half the peak
    memory of ``["a", "b"]`` pairs (Gemma 3's 515k merges: 164 MiB, not 355)."""
    beside.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    file = folder / "tokenizer.json"
    if not file.is_file():
        return
    saved = json.loads(file.read_text(encoding="utf-8"))
    merges = saved.get("model", {}).get("merges")
    if not merges or not all(isinstance(m, list) and len(m) == 2 and " " not in m[0] + m[1] for m in merges):
        return
    saved["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    file.write_text(json.dumps(saved, ensure_ascii=False), encoding="utf-8")


def saved_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The tokenizer ``save_pretrained`` wrote to ``folder``, read in one pass of its ``tokenizer.json``.

    The saved ``tokenizer.json`` holds the whole pipeline (normalizer, pre-tokenizer, post-processor adding BOS,
    decoder, added tokens), so the generic fast tokenizer over it encodes and decodes as the model-specific class
    does (tested). The model classes rebuild the backend from Python lists of the vocabulary and merges instead:
    for Gemma 3's 262k tokens and 515k merges that holds 450 MiB where this holds 100 MiB, and its loading peaks
    at twice this one's (bench/RESULTS.md, session 29; `_save_folder` halves that peak again)."""
    settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    for key in ("tokenizer_class", "backend", "is_local", "local_files_only", "auto_map"):
        settings.pop(key, None)
    template = folder / "chat_template.jinja"
    if "chat_template" not in settings and template.is_file():
        settings["chat_template"] = template.read_text(encoding="utf-8")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **settings)
    tokenizer.name_or_path = str(folder)
    release_freed_memory()  # the JSON parse's transients (several times the tokenizer), before the weights load
    return tokenizer


def load_error(path: Path, exc: BaseException) -> ModelLoadError:
    """One line that names the file and what transformers or gguf could not do."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, NotImplementedError) and "quantiz" in text.lower():
        return ModelLoadError(f"cannot dequantize GGUF file '{path}': {text} (a quantisation type transformers lacks)")
    if "architecture" in text.lower() or "model_type" in text.lower():
        return ModelLoadError(f"cannot load GGUF file '{path}': {text}")
    return ModelLoadError(f"cannot load GGUF file '{path}' (truncated or corrupt?): {type(exc).__name__}: {text}")


def _dequantize(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        import accelerate  # noqa: F401
        import gguf  # noqa: F401  (transformers needs it; say so before it fails deep inside)
    except ImportError as exc:
        raise ModelLoadError(
            f"loading a GGUF file needs the '{exc.name}' package: pip install 'lattice-inference[gguf]'"
        ) from exc
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # gguf and transformers raise many types for bad files; all are the user's file
        raise load_error(path, exc) from exc
    # The weights are plain dequantized tensors now; drop the GGUF quantizer mark so the model can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Write the model's folder atomically; a failure only skips caching."""
    _write_atomically(target, lambda tmp: _save_folder(tokenizer, tmp, model))


def _write_atomically(target: Path, write: Callable[[Path], object]) -> None:
    """``write`` a folder under a temporary sibling, renamed into place when done; a failure only skips caching."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        write(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def load_gguf(
    path: str | Path, dtype: torch.dtype, device: torch.device | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the GGUF file ``path`` dequantized to ``dtype`` (from the cache when it was loaded before; a cached
    dequantization is loaded straight onto a CUDA ``device``, a first one is made on the CPU)."""
    path = Path(path)
    check_gguf_file(path)
    cached = _cache_dir(path, dtype) if cache_enabled() else None
    if cached is not None and (cached / "config.json").is_file():
        try:
            tokenizer = saved_tokenizer(cached)
            return AutoModelForCausalLM.from_pretrained(cached, dtype=dtype, **device_map(device)), tokenizer
        except Exception:  # a damaged cache entry: rebuild it from the GGUF file
            shutil.rmtree(cached, ignore_errors=True)
    model, tokenizer = _dequantize(path, dtype)
    if cached is not None:
        _save(model, tokenizer, cached)
    return model, tokenizer


def dequantized_folder(path: str | Path, dtype: torch.dtype) -> Path:
    """The cached Hugging Face folder of the GGUF file ``path`` dequantized to ``dtype``, written first when it
    is missing: what engines that read only Hugging Face folders (vLLM) load."""
    path = Path(path)
    check_gguf_file(path)
    cached = _cache_dir(path, dtype)
    if not (cached / "config.json").is_file():
        model, tokenizer = _dequantize(path, dtype)
        _save(model, tokenizer, cached)
        if not (cached / "config.json").is_file():
            raise ModelLoadError(f"cannot write the dequantized copy of '{path}' under '{cached.parent}'")
    return cached
