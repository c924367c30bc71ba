"""Tool calls (OpenAI ``tools`` / ``tool_choice``) in the Hermes syntax, constrained where a call is required.

A model calls a tool by writing ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``: the syntax of
Qwen2.5's chat template (and Hermes', NousResearch's), which most instruct models with tool support were tuned on.

- **The prompt.** Where the tokenizer's chat template has a tools section (it mentions ``tools``: Qwen2.5's does),
  the tools go through it (`PromptCodec.chat_ids`). Where it has none (the default SmolLM2), `tools_prompt` writes
  the same instructions Qwen2.5's template writes into the system message, so such a model is asked in that syntax.
- **The output.** ``tool_choice: "required"`` or a named function constrains the output with `tools_grammar`: one
  or more calls (one, to a named function) whose ``name`` is a declared tool and whose ``arguments`` follow that
  tool's ``parameters`` schema, written as Qwen2.5's template writes a call (``", "`` and ``": "`` separators).
  Every token of that syntax the grammar forces is drafted for free (`lattice_inference.grammar`), and the output
  is still exactly plain constrained decoding's. ``"auto"`` leaves the output free, as vLLM does: the model writes
  text, calls, or both, and `ToolCallParser` splits them (for SmolLM2 that means it calls a tool only when it
  chooses to write the syntax it was shown). ``"none"`` leaves the tools out of the prompt altogether.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lattice_inference.errors import ConfigError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
"""The tags around each call."""
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How a call's JSON is written (``json.dumps``' default separators, as chat templates' ``tojson`` writes it)."""
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does and the JSON schema of its arguments."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI's ``tools`` entry (what chat templates render)."""
        function = {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: an id for the client to answer with, the function's name and its arguments (JSON
    text, as OpenAI sends them)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry (with ``index`` in a streamed chunk)."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def chosen_tools(tools: Sequence[Tool], choice: str | Mapping[str, Any] | None) -> tuple[str, list[Tool]]:
    """``(mode, tools)`` for a request: ``mode`` is ``"none"``, ``"auto"`` or ``"required"`` (a named function is
    ``"required"`` of that one tool); `ConfigError` names a choice that names no declared tool, or tools missing."""
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ConfigError("tools: two tools have the same name")
    if choice is None:
        return ("auto" if tools else "none"), list(tools)
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise ConfigError(
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function, got {choice!r}"
            )
        if choice != "none" and not tools:
            raise ConfigError(f"tool_choice {choice!r} needs tools")
        return choice, list(tools)
    function = choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    matches = [t for t in tools if t.name == name]
    if not matches:
        raise ConfigError(f"tool_choice names function {name!r}, which is not among the tools ({', '.join(names)})")
    return "required", matches


def tools_grammar(tools: Sequence[Tool], *, parallel: bool = True) -> str:
    """A Lark grammar (llguidance's, with ``%json``) of tool calls in the Hermes syntax: a call to one of
    ``tools``, its arguments following the tool's schema; with ``parallel``, more calls may follow, a newline
    apart."""
    if not tools:
        raise ConfigError("a tool-call grammar needs at least one tool")
    options = []
    for tool in tools:
        properties = {"name": {"const": tool.name}, "arguments": dict(tool.parameters)}
        options.append(
            {
                "type": "object",
                "properties": properties,
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = {"x-guidance": JSON_STYLE, **(options[0] if len(options) == 1 else {"anyOf": options})}
    calls = 'call ("\\n" call)*' if parallel else "call"
    return f'start: {calls}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: %json {json.dumps(schema)}\n'


def tools_prompt(tools: Sequence[Tool]) -> str:
    """The tool instructions Qwen2.5's chat template writes into the system message, for a template without a
    tools section."""
    listed = "\n".join(json.dumps(tool.as_openai(), ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f"{OPEN}{CLOSE} XML tags:\n{OPEN}\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        f"{CLOSE}"
    )


def template_has_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders the ``tools`` it is given (it mentions them at all)."""
    return bool(chat_template) and "tools" in str(chat_template)


def parse_call(body: str, *, cut: bool = False) -> ToolCall | None:
    """The call written between the tags (None: not a JSON object with a string ``name``). ``cut``: the output
    ended inside the call, so what follows the JSON may be the start of the closing tag."""
    text = body.strip()
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    rest = text[end:].strip()
    if rest and not (cut and CLOSE.startswith(rest)):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(value["name"], text)


class ToolCallParser:
    """Splits a generation's text, as it arrives, into the content the client sees and the calls it made.

    Text outside the tags is content (a possible start of ``<tool_call>`` is held back until it is known not to be
    one); the text between the tags is a call, released when its closing tag arrives (`flush`: when the output
    ends), or given back as content where it does not parse."""

    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False
        self._after_call = False
        self.calls: list[ToolCall] = []
        """Every call parsed so far."""

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content released by ``text`` and the calls it completed."""
        self._buffer += text
        content, calls = [], []
        while True:
            if not self._inside:
                if self._after_call:  # the newlines between calls (and after the last) are not content
                    self._buffer = self._buffer.lstrip("\n")
                    self._after_call = not self._buffer
                at = self._buffer.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buffer, OPEN)
                    content.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content.append(self._buffer[:at])
                self._buffer, self._inside = self._buffer[at + len(OPEN) :], True
            else:
                at = self._buffer.find(CLOSE)
                if at < 0:
                    break
                body, self._buffer, self._inside = self._buffer[:at], self._buffer[at + len(CLOSE) :], False
                call = parse_call(body)
                if call is None:
                    content.append(f"{OPEN}{body}{CLOSE}")
                else:
                    calls.append(call)
                self._after_call = call is not None
        self.calls += calls
        return "".join(content), calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        """The end of the output: a call left open is released if it parses (a generation cut at its budget
        before the closing tag), else it is content."""
        rest, inside = self._buffer, self._inside
        self._buffer, self._inside = "", False
        if not inside:
            return rest, []
        call = parse_call(rest, cut=True)
        if call is None:
            return OPEN + rest, []
        self.calls.append(call)
        return "", [call]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def tool_messages(messages: Sequence[Mapping[str, Any]], native: bool) -> list[dict[str, Any]]:
    """A conversation's tool turns as the chat template takes them. ``native`` (a template with a tools section):
    assistant calls keep ``tool_calls`` with their arguments as objects (templates write them with ``tojson``),
    tool results keep role ``tool``. Otherwise calls become the assistant's text in the Hermes syntax and results
    a user turn in ``<tool_response>`` tags, as Qwen2.5's template writes them."""
    out: list[dict[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls") or []
        if message["role"] == "assistant" and calls:
            if native:
                converted = []
                for call in calls:
                    function = dict(call["function"])
                    try:
                        function["arguments"] = json.loads(function.get("arguments") or "{}")
                    except ValueError:
                        pass
                    converted.append({"type": "function", "function": function})
                out.append({"role": "assistant", "content": message.get("content") or "", "tool_calls": converted})
            else:
                written = [
                    f'{OPEN}\n{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
                    f"{c['function'].get('arguments') or '{}'}}}\n{CLOSE}"
                    for c in calls
                ]
                text = "\n".join(filter(None, [message.get("content") or "", *written]))
                out.append({"role": "assistant", "content": text})
        elif message["role"] == "tool" and not native:
            out.append(
                {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
            )
        else:
            out.append(dict(message))
    return out
