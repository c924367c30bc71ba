"""A stand-alone MTP head for any model: ``NAME.safetensors`` (``mtp.*`` tensors) and ``NAME.json`` beside it.

``lattice train-mtp`` writes one; ``--mtp-head PATH`` (CLI, server) and ``Generator.from_pretrained(mtp_head=PATH)``
load one. The head is the Qwen3.5 MTP layer (`lattice_inference.mtp.layer`), sized from the target's config; it
uses the target's own embedding and ``lm_head`` (frozen, not stored), so a file holds only the layer itself.

The JSON records the head's shapes (``mtp``), the target it was trained on (``target``: the config fields that
must match), an optional default draft vocabulary (``draft_vocab``: ids below N) and free-form ``training``
notes. Loading checks every recorded target field against the model and names the first that differs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lattice_inference.errors import ModelLoadError
from lattice_inference.mtp.config import MtpConfig
from lattice_inference.mtp.head import MtpHead
from lattice_inference.mtp.weights import load_mtp_weights

FORMAT = "lattice-mtp-head"
VERSION = 1
#: Target config fields a head must agree with (beyond its own shapes): the trunk that made its hiddens.
TARGET_FIELDS = ("model_type", "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads")
_MTP_FIELDS = tuple(f.name for f in dataclasses.fields(MtpConfig) if f.name != "draft_length")


def _text_config(config: Any) -> Mapping[str, Any]:
    """The text part of a transformers config (a dict or config object), unwrapping ``text_config``."""
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    text = raw.get("text_config")
    return text if isinstance(text, Mapping) else raw


def target_fields(config: Any) -> dict[str, Any]:
    """The `TARGET_FIELDS` of a model's config, as recorded in a head file."""
    text = _text_config(config)
    return {key: text.get(key) for key in TARGET_FIELDS}


def config_for_target(config: Any, *, draft_length: int = 4) -> MtpConfig:
    """An `MtpConfig` for a head on the model whose transformers config is ``config``: one dense decoder layer
    with the target's hidden size, heads, head_dim, MLP width and RMSNorm epsilon; RoPE from the target's
    ``rope_theta`` (rotating the whole head_dim unless the target rotates less)."""
    text = _text_config(config)
    rope = text.get("rope_parameters") or {}
    hidden, n_h = int(text["hidden_size"]), int(text["num_attention_heads"])
    return MtpConfig(
        draft_length=draft_length,
        hidden_size=hidden,
        vocab_size=int(text["vocab_size"]),
        num_attention_heads=n_h,
        num_key_value_heads=int(text.get("num_key_value_heads") or n_h),
        head_dim=int(text.get("head_dim") or hidden // n_h),
        rms_norm_eps=float(text.get("rms_norm_eps") or 1e-6),
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10_000.0))),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))),
        num_experts=0,
        intermediate_size=int(text.get("intermediate_size") or 4 * hidden),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        model_type=str(text.get("model_type")),
    )


#: Heads shipped in the package (``lattice_inference/heads/NAME/``), by the file name of the model they serve.
SHIPPED_HEADS = {"SmolLM2-135M-Instruct.Q4_1.gguf": "smollm2"}
HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"


def shipped_head(source: str | Path) -> Path | None:
    """The packaged head for the model loaded from ``source`` (a file or folder), or None."""
    name = SHIPPED_HEADS.get(Path(source).name)
    if name is None:
        return None
    path = HEADS_DIR / name / "mtp_head.safetensors"
    return path if path.is_file() else None


def head_paths(path: str | Path) -> tuple[Path, Path]:
    """``(NAME.safetensors, NAME.json)`` for a head given as either file or as a folder holding exactly one."""
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("*.safetensors"))
        if len(found) != 1:
            raise ModelLoadError(f"MTP head folder '{p}' should hold one .safetensors file, found {len(found)}")
        p = found[0]
    if p.suffix == ".json":
        p = p.with_suffix(".safetensors")
    if not p.is_file():
        raise ModelLoadError(f"MTP head '{p}' does not exist")
    meta = p.with_suffix(".json")
    if not meta.is_file():
        raise ModelLoadError(f"MTP head '{p}' has no config '{meta.name}' beside it")
    return p, meta


def read_head_meta(path: str | Path) -> dict[str, Any]:
    """The JSON config of the head at ``path`` (validated format)."""
    _, meta_path = head_paths(path)
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read MTP head config '{meta_path}': {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ModelLoadError(f"'{meta_path}' is not an MTP head config (format {FORMAT!r})")
    if not isinstance(meta.get("mtp"), dict) or not isinstance(meta.get("target"), dict):
        raise ModelLoadError(f"MTP head config '{meta_path}' lacks its 'mtp' or 'target' section")
    return meta


def check_fits(meta: Mapping[str, Any], config: Any, hidden_size: int, vocab_size: int) -> None:
    """Raise `ModelLoadError` naming the first field where the head does not fit the model."""
    mtp = meta["mtp"]
    for name, have in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if mtp.get(name) != have:
            raise ModelLoadError(
                f"MTP head does not fit this model: {name} is {mtp.get(name)} in the head, {have} here"
            )
    model = target_fields(config)
    for name, want in meta["target"].items():
        if name in model and model[name] != want:
            raise ModelLoadError(
                f"MTP head does not fit this model: target config field {name} is {want!r} in the head, "
                f"{model[name]!r} here"
            )


def read_head_tensors(path: str | Path, config: Any, cfg: MtpConfig) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The raw ``mtp.*`` tensors (float32) and JSON config of the head at ``path``, checked to fit the model with
    transformers ``config`` and the head shape ``cfg`` (the field that differs is named): what a training run
    that starts from an existing head reads."""
    tensors_path, meta_path = head_paths(path)
    meta = read_head_meta(path)
    check_fits(meta, config, cfg.hidden_size, cfg.vocab_size)
    for name in _MTP_FIELDS:
        have, want = meta["mtp"].get(name), getattr(cfg, name)
        if have != want:
            raise ModelLoadError(f"MTP head '{meta_path}' has {name} {have!r}; a head for this model has {want!r}")
    from safetensors import safe_open

    with safe_open(str(tensors_path), framework="pt") as f:
        tensors = {k: f.get_tensor(k).float() for k in f.keys() if k.startswith("mtp.")}
    return tensors, meta


def load_head_file(
    path: str | Path,
    config: Any,
    embed_tokens: torch.Tensor,
    lm_head: torch.Tensor,
    *,
    draft_length: int = 4,
) -> tuple[MtpHead, dict[str, Any]]:
    """Load the head at ``path`` for the model with transformers ``config`` and its own embedding / ``lm_head``
    (dtype and device follow ``lm_head``); returns the head and its JSON config. Nothing is built unless the
    head fits the model (`check_fits`) and its tensors validate."""
    tensors, _ = head_paths(path)
    meta = read_head_meta(path)
    check_fits(meta, config, int(lm_head.shape[1]), int(lm_head.shape[0]))
    fields = {k: v for k, v in meta["mtp"].items() if k in _MTP_FIELDS}
    try:
        cfg = MtpConfig(draft_length=draft_length, **fields)
    except TypeError as exc:
        raise ModelLoadError(f"MTP head config '{tensors.with_suffix('.json')}' is invalid: {exc}") from exc
    weights = load_mtp_weights(
        tensors, cfg, dtype=lm_head.dtype, device=lm_head.device, embed_tokens=embed_tokens, lm_head=lm_head
    )
    return MtpHead(cfg, weights), meta


def write_atomic(path: Path, write: Any) -> None:
    """Call ``write(tmp_path)`` then rename onto ``path``: a reader never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_head_file(
    path: str | Path,
    tensors: Mapping[str, torch.Tensor],
    cfg: MtpConfig,
    target: Mapping[str, Any],
    *,
    dtype: torch.dtype = torch.bfloat16,
    draft_vocab: int | None = None,
    training: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``NAME.safetensors`` (``tensors``: ``mtp.*`` names, cast to ``dtype``) and ``NAME.json``, each
    atomically; ``path`` is the ``.safetensors`` file. Returns it."""
    out = Path(path).with_suffix(".safetensors")
    data = {k: v.detach().to(dtype=dtype, device="cpu").contiguous() for k, v in tensors.items()}
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "mtp": {k: getattr(cfg, k) for k in _MTP_FIELDS},
        "target": dict(target),
        "draft_vocab": draft_vocab,
        "training": dict(training or {}),
    }
    write_atomic(out, lambda tmp: save_file(data, str(tmp), metadata={"format": FORMAT}))
    write_atomic(out.with_suffix(".json"), lambda tmp: tmp.write_text(json.dumps(meta, indent=2) + "\n"))
    return out
