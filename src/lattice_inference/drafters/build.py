"""Drafters from options: the one place a method's `DecodeOptions` become the drafter that runs it.

`Generator` (and through it the server and ``lattice bench``) builds its drafter here, so each method's drafters,
their settings and the draft cap the decoder verifies are decided once.
"""

from __future__ import annotations

from collections.abc import Sequence

from lattice_inference.drafters.base import Drafter
from lattice_inference.drafters.fallback import FallbackDrafter
from lattice_inference.drafters.mtp import MtpDrafter
from lattice_inference.drafters.ngram import NgramDrafter
from lattice_inference.drafters.suffix import SuffixDrafter
from lattice_inference.errors import ConfigError
from lattice_inference.mtp.head import MtpHead
from lattice_inference.options import DecodeOptions


def build_drafter(
    options: DecodeOptions, eos_token_ids: Sequence[int], mtp_head: MtpHead | None = None
) -> tuple[Drafter | None, int]:
    """The drafter of ``options.method`` (None for greedy; a `FallbackDrafter` where the method asks several)
    and the most tokens a round may verify: ``max_draft``, or the MTP head's ``draft_length - 1`` where the head
    drafts alone (with another drafter, the larger of the two). ``mtp_head`` is needed by the MTP methods."""
    if options.needs_mtp_head and mtp_head is None:
        raise ConfigError(
            f"method {options.method!r} needs an MTP head: pass mtp_head=load_mtp_head(dir) or use from_pretrained"
        )
    drafters: list[Drafter] = []
    max_draft = options.max_draft
    if "ngram" in options.drafters:
        drafters.append(
            NgramDrafter(
                max_ngram=options.max_ngram,
                min_ngram=options.min_ngram,
                max_draft=options.max_draft,
                match=options.match,
                eos_token_ids=eos_token_ids,
            )
        )
    if "suffix" in options.drafters:  # its per-request lookup takes the ngram method's settings
        drafters.append(
            SuffixDrafter(
                options.suffix_budget,
                options.max_draft,
                eos_token_ids,
                max_ngram=options.max_ngram,
                min_ngram=options.min_ngram,
                match=options.match,
            )
        )
    if "mtp" in options.drafters and mtp_head is not None:
        num = options.draft_length - 1
        drafters.append(
            MtpDrafter(mtp_head, num_drafts=num, eos_token_ids=eos_token_ids, coupled=options.coupled_draft)
        )
        max_draft = max(max_draft, num) if len(options.drafters) > 1 else num
    if not drafters:
        return None, max_draft
    return (drafters[0] if len(drafters) == 1 else FallbackDrafter(drafters)), max_draft
