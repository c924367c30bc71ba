"""Prompt encoding without a loaded model, for engines that run the model elsewhere (vLLM).

`PromptEncoder` borrows `Generator`'s own ``encode``/``encode_messages`` (they use only the tokenizer), so a
prompt becomes the same token ids whichever engine runs it: both engines then see identical input.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lattice_inference.api import Generator


class PromptEncoder:
    """A tokenizer with `Generator`'s prompt encoding (chat template, plain text, conversations)."""

    has_chat_template = Generator.has_chat_template
    encode = Generator.encode
    encode_messages = Generator.encode_messages

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def from_folder(cls, folder: str | Path) -> PromptEncoder:
        """The tokenizer of a Hugging Face model folder."""
        return cls(AutoTokenizer.from_pretrained(str(folder)))


def eos_token_ids(folder: str | Path, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """EOS ids of a model folder as the local engine takes them: the generation config's, else the model
    config's, else the tokenizer's."""
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((Path(folder) / name).read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if value is not None:
            return tuple(int(i) for i in (value if isinstance(value, list) else [value]))
    return () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)
