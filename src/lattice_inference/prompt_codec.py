"""The prompt codec: a tokenizer with its chat template and EOS ids, shared by every front-end.

`Generator`, the server (`lattice_inference.serve.engine`) and the engines (vLLM's, which runs the model in
another process) all turn prompts into token ids through one `PromptCodec`, so a prompt becomes the same ids
whichever of them runs it, and every one stops at the same EOS tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lattice_inference.errors import ConfigError
from lattice_inference.tool_calls import Tool, template_has_tools, tool_messages, tools_prompt

#: An EOS setting as configs hold it: one id, a list of ids, or None (unset).
EosSetting = int | Sequence[int] | None


def eos_ids(declared: Iterable[EosSetting], tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The EOS ids of a model: the first of ``declared`` that is set (the generation config's, then the model
    config's), else the tokenizer's EOS, else none. The local engine and the vLLM engine both take them so."""
    for value in declared:
        if value is not None:
            return tuple(int(i) for i in value) if isinstance(value, Sequence) else (int(value),)
    return () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)


def folder_eos_ids(folder: str | Path, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """`eos_ids` of a model folder read from its JSON files, without loading the model (for the vLLM engine)."""
    declared: list[EosSetting] = []
    for name in ("generation_config.json", "config.json"):
        try:
            declared.append(json.loads((Path(folder) / name).read_text()).get("eos_token_id"))
        except (OSError, ValueError):
            continue
    return eos_ids(declared, tokenizer)


class PromptCodec:
    """A tokenizer with the prompt encodings every front-end uses: text (optionally through the chat template),
    conversations, raw token ids; and the model's ``eos_token_ids``."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Iterable[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)

    @classmethod
    def from_folder(cls, folder: str | Path) -> PromptCodec:
        """The codec of a Hugging Face model folder (its tokenizer and EOS ids), without loading the model."""
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        return cls(tokenizer, folder_eos_ids(folder, tokenizer))

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer defines a chat template (instruct models do)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def text_ids(self, text: str) -> list[int]:
        """Token ids of plain ``text``, with the tokenizer's special tokens (a BOS where it adds one)."""
        return list(self.tokenizer(text, add_special_tokens=True).input_ids)

    def continuation_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` as an output would spell it: no special tokens (a prediction of the output)."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def chat_ids(self, turns: Sequence[Mapping[str, Any]], tools: Sequence[Tool] = ()) -> list[int]:
        """Token ids of ``turns`` (``{"role", "content"}``, and the tool turns of `tool_messages`) through the chat
        template, the assistant's turn opened (``add_generation_prompt``), offering ``tools``: through the
        template's tools section where it has one, else as Qwen2.5's instructions in the system message
        (`lattice_inference.tool_calls`). The caller has checked the turns (the template may still refuse them)."""
        native = template_has_tools(getattr(self.tokenizer, "chat_template", None))
        messages = tool_messages(turns, native)
        extra: dict[str, Any] = {}
        if tools and native:
            extra["tools"] = [tool.as_openai() for tool in tools]
        elif tools:
            prompt = tools_prompt(tools)
            if messages and messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
            else:
                messages.insert(0, {"role": "system", "content": prompt})
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **extra
        )
        return [int(t) for t in cast(list[int], ids)]

    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Token ids of ``prompt``; text is wrapped in the chat template first when ``chat`` is true."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if not prompt.strip():
            raise ConfigError("the prompt is empty")
        if chat:
            return self.encode_messages([{"role": "user", "content": prompt}])
        return self.text_ids(prompt)

    def encode_messages(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a conversation (``[{"role", "content"}, ...]``) through the tokenizer's chat template,
        ending with the assistant's turn opened; `ConfigError` for a malformed one."""
        if not self.has_chat_template:
            raise ConfigError("chat: this tokenizer has no chat template")
        if not messages:
            raise ConfigError("the message list is empty")
        for i, msg in enumerate(messages):
            if not isinstance(msg, Mapping) or not isinstance(msg.get("content"), str) or "role" not in msg:
                raise ConfigError(f"message {i} must be an object with string 'role' and 'content', got {msg!r}")
        return self.chat_ids(messages)
