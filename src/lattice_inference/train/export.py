"""Writing a trained head where `lattice_inference.mtp.head_file` loads it: ``OUT/mtp_head.{safetensors,json}``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lattice_inference.mtp.head_file import save_head_file, target_fields
from lattice_inference.train.model import TrainableHead

HEAD_NAME = "mtp_head.safetensors"


def export_head(
    head: TrainableHead,
    model_config: Any,
    out_dir: Path,
    *,
    draft_vocab: int | None,
    training: Mapping[str, Any],
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Save ``head`` (``dtype``) with the target's config fields, the draft vocabulary and training notes;
    returns the ``.safetensors`` path. Both files are replaced atomically."""
    return save_head_file(
        out_dir / HEAD_NAME,
        head.checkpoint_tensors(),
        head.cfg,
        target_fields(model_config),
        dtype=dtype,
        draft_vocab=draft_vocab,
        training=training,
    )
