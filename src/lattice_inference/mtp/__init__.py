"""Multi-token-prediction (MTP) heads of Qwen3-Next / Qwen3.5 checkpoints.

``load_mtp_head(model_dir)`` reads ``config.json`` and the checkpoint's own ``mtp.*`` tensors (transformers drops them
at load) and returns an :class:`MtpHead` with ``reset_cache()``, ``rollback_cache_to(n)``, ``forward_one(token_id,
position, previous_hidden) -> (logits, hidden)``, ``forward_many(...)``, ``prefill(...)`` and ``draft_tokens(...)``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lattice_inference.mtp.config import MtpConfig
from lattice_inference.mtp.head import MtpHead
from lattice_inference.mtp.weights import MtpWeights, load_mtp_weights

__all__ = ["MtpConfig", "MtpHead", "MtpWeights", "load_mtp_head"]


def load_mtp_head(
    model_dir: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    *,
    draft_length: int = 4,
    max_seq_len: int | None = None,
    embed_tokens: torch.Tensor | None = None,
    lm_head: torch.Tensor | None = None,
) -> MtpHead:
    """Build the MTP head of the Qwen3-Next / Qwen3.5 checkpoint in ``model_dir``.

    ``dtype`` is ``torch.float32`` or ``torch.bfloat16`` (None: bfloat16 for a bfloat16 checkpoint, else float32).
    ``draft_length`` counts the target token (2..8). ``embed_tokens`` / ``lm_head`` may pass the target model's own
    ``[vocab, hidden]`` tensors to avoid reading a second copy. Raises ``ConfigError`` for an unsupported config and
    ``ModelLoadError`` for missing, quantised or mis-shaped tensors; nothing is built unless everything validates.
    """
    config = MtpConfig.from_hf_config(Path(model_dir), draft_length=draft_length)
    weights = load_mtp_weights(
        model_dir, config, dtype=dtype, device=device, embed_tokens=embed_tokens, lm_head=lm_head
    )
    return MtpHead(config, weights, max_seq_len=max_seq_len)
