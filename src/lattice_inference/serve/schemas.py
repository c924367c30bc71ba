"""Request bodies of the OpenAI endpoints, validated with pydantic (strict types: ``"5"`` is not a number).

Fields this server cannot honour are refused with a 400 that names them rather than silently ignored, unless
they hold the value that means "off" (``echo: false``, ``best_of: 1``, ...).
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lattice_inference.errors import ConfigError
from lattice_inference.options import MAX_DRAFT_LENGTH, METHODS, MIN_DRAFT_LENGTH, REQUEST_LENGTH_LIMIT, MatchPolicy
from lattice_inference.sampling import SamplingOptions
from lattice_inference.serve.errors import APIError, bad_request
from lattice_inference.tool_calls import Tool, chosen_tools

ROLES = ("system", "developer", "user", "assistant", "tool")
#: Longest stop string accepted (holding back a possible stop's start costs up to its length squared per round).
MAX_STOP_LENGTH = 1000

#: Fields of the OpenAI API this server does not implement, and the values of them it accepts (all "off").
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
}


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_off(value: object, off: object) -> bool:
    """Whether ``value`` is the "off" value ``off``: numbers by value (``0``, ``0.0`` and ``-0.0`` alike, as
    clients serialise them differently), anything else by value and type (``false`` is not ``0``)."""
    if _is_number(off):
        return _is_number(value) and value == off
    return value == off and type(value) is type(off)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class Speculative(_Strict):
    """The ``speculative`` extension: speculation settings for one request (unset fields: the server's)."""

    method: str | None = None
    max_draft: int | None = Field(None, ge=1, le=REQUEST_LENGTH_LIMIT)
    max_ngram: int | None = Field(None, ge=1, le=REQUEST_LENGTH_LIMIT)
    min_ngram: int | None = Field(None, ge=1, le=REQUEST_LENGTH_LIMIT)
    match: MatchPolicy | None = None
    draft_length: int | None = Field(None, ge=MIN_DRAFT_LENGTH, le=MAX_DRAFT_LENGTH)
    adaptive: bool | None = None
    """False verifies every drafted token (``--fixed-draft``); True lets the draft planner choose."""
    scope: str | None = Field(None, min_length=1, max_length=200)
    """The suffix methods' scope: requests sending the same scope (under the same API key) draft from each other."""
    clear_index: bool | None = None
    """True clears this request's scope's suffix index before it runs."""
    show_drafts: bool | None = None
    """True: each streamed chunk carries ``speculative.drafted``, the spans of the generated text (character offsets,
    end exclusive) whose tokens came from accepted drafts (the chat page shows them)."""

    @field_validator("method")
    @classmethod
    def _known_method(cls, method: str | None) -> str | None:
        if method is not None and method not in METHODS:
            raise ValueError(f"unknown speculation method {method!r}; choose from {', '.join(METHODS)}")
        return method


#: `Speculative` fields that choose where a request drafts from or what it reports, not how it drafts (no part of
#: `DecodeOptions`).
SCOPE_FIELDS = frozenset({"scope", "clear_index", "show_drafts"})


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: the schema the output must follow (``strict`` or not: it is enforced)."""

    name: str | None = Field(None, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` (any JSON object) or
    ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs 'json_schema': {'name': ..., 'schema': {...}}")
        return self

    def grammar_source(self) -> dict[str, Any] | None:
        """The form `lattice_inference.grammar.response_format_grammar` reads (None: text)."""
        if self.type == "text":
            return None
        if self.json_schema is None:
            return {"type": self.type}
        return {"type": self.type, "json_schema": {"schema": self.json_schema.json_schema}}


class FunctionDef(_Strict):
    """A tool's function: its name, description and the JSON schema of its arguments."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    """An entry of ``tools`` (functions only, as OpenAI's chat completions)."""

    type: Literal["function"]
    function: FunctionDef

    def tool(self) -> Tool:
        """The library's `Tool`."""
        f = self.function
        parameters = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
        return Tool(f.name, f.description or "", parameters)


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``tool_choice`` naming one function: ``{"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: str
    arguments: str = "{}"


class MessageToolCall(_Strict):
    """A call in an earlier assistant message (what this server returned, sent back with the tool's answer)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    include_usage: bool = False


class ContentPart(_Strict):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is understood."""

    type: str
    text: str | None = None


def _text_parts(content: Any) -> Any:
    """``content`` (a string, text parts or None) as given, or a ValueError naming a part that is not text."""
    for part in content if isinstance(content, list) else ():
        if part.type != "text" or part.text is None:
            raise ValueError(f"content parts of type {part.type!r} are not supported; only text")
    return content


def _joined(content: str | list[ContentPart] | None) -> str:
    """``content`` as one string (its text parts joined; None: empty)."""
    if isinstance(content, list):
        return "".join(part.text or "" for part in content)
    return content or ""


class Prediction(_Strict):
    """OpenAI's predicted outputs: ``{"type": "content", "content": "..."}`` (or its text parts), what the output
    will mostly be (the file an edit reproduces). Drafted from, verified like any draft: the output is what the
    request gives without it."""

    type: Literal["content"]
    content: str | list[ContentPart]

    _text_only = field_validator("content")(classmethod(lambda cls, content: _text_parts(content)))

    def text(self) -> str:
        """The predicted text as one string."""
        return _joined(self.content)


class _Generation(_Strict):
    """Fields shared by chat and text completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    top_k: int | None = Field(None, ge=0)
    """Extension (as vLLM): sample among the k most likely tokens (0: off)."""
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    """Extension (as vLLM): drop tokens below ``min_p`` x the top probability (0: off)."""
    presence_penalty: float | None = None
    """OpenAI's: subtracted from the logit of each token generated so far (0: off; range checked by
    `SamplingOptions`, as every sampling value)."""
    frequency_penalty: float | None = None
    """OpenAI's: subtracted, times the token's count so far, from its logit (0: off)."""
    repetition_penalty: float | None = None
    """Extension (as vLLM; transformers' definition, prompt included): 1 is off."""
    stop: str | list[str] | None = None
    n: int = 1
    speculative: Speculative | None = None
    logit_bias: dict[str, float] | None = None
    """OpenAI's: token id (as a string) to a bias in -100..100 added to its logit, in every row alike."""
    response_format: ResponseFormat | None = None
    """OpenAI's structured output: the output follows a JSON schema, or is any JSON object (a grammar's masks)."""
    prediction: Prediction | None = None
    """OpenAI's predicted outputs: drafted from first (`lattice_inference.drafters.prediction`)."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, accepted in UNSUPPORTED.items():
                value = data.get(name)
                if not any(is_off(value, ok) for ok in accepted):
                    raise ValueError(f"'{name}' is not supported by this server (only its neutral value)")
        return data

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n must be 1: this server generates one choice per request, got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise ValueError(f"stop strings may have at most {MAX_STOP_LENGTH} characters")
        return stop

    def sampling_fields(self) -> dict[str, Any]:
        """The request's values of `SamplingOptions`' fields (None where the request leaves one unset)."""
        return {f.name: getattr(self, f.name) for f in fields(SamplingOptions)}

    def grammar_source(self) -> dict[str, Any] | None:
        """The ``response_format`` as `lattice_inference.grammar.response_format_grammar` reads it (None: text)."""
        return None if self.response_format is None else self.response_format.grammar_source()

    @property
    def stops(self) -> list[str]:
        """The stop strings as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def requested_max_tokens(self) -> int | None:
        """The client's token budget, if it set one."""
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def top_logprobs_count(self) -> int | None:
        """How many most likely tokens to list beside each token's log-probability; None: no log-probabilities."""
        return None


class Message(_Strict):
    """A chat message: its role and text; an assistant's may hold the ``tool_calls`` it made, a tool's answer names
    the call it answers (``tool_call_id``)."""

    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; choose from {', '.join(ROLES)}")
        return role

    _text_only = field_validator("content")(classmethod(lambda cls, content: _text_parts(content)))

    def text(self) -> str:
        """The message's content as one string."""
        return _joined(self.content)

    def turn(self) -> dict[str, Any]:
        """The message as the chat template takes it (`lattice_inference.tool_calls.tool_messages` converts its
        tool turns): ``developer`` read as ``system``."""
        turn: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            turn["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            turn["name"] = self.name
        return turn


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``."""

    messages: list[Message]
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    """False: at most one call per turn (a required call's grammar allows one)."""
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    """Return each output token's log-probability (``choices[].logprobs.content``)."""
    top_logprobs: int | None = Field(None, ge=0, le=20)
    """With ``logprobs``: how many most likely tokens to list at each position (0..20)."""

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _tools_or_format(self) -> ChatCompletionRequest:
        if self.tools and self.tool_choice != "none" and self.grammar_source() is not None:
            raise ValueError("response_format cannot be combined with tools (unless tool_choice is 'none')")
        return self

    @property
    def parallel_calls(self) -> bool:
        """Whether a required answer may hold several calls: not to a named function (OpenAI: "call that
        function"), nor with ``parallel_tool_calls: false``."""
        return self.parallel_tool_calls is not False and not isinstance(self.tool_choice, NamedToolChoice)

    def tool_mode(self) -> tuple[str, list[Tool]]:
        """``(mode, tools)`` (`lattice_inference.tool_calls.chosen_tools`: ``"none"``, ``"auto"`` or
        ``"required"``, with the tools offered), or a 400 naming a choice without its tool."""
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        try:
            return chosen_tools([t.tool() for t in self.tools or []], choice)
        except ConfigError as exc:
            raise bad_request(str(exc), param="tool_choice") from None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[Message]) -> list[Message]:
        if not messages:
            raise ValueError("messages must hold at least one message")
        return messages

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Generation):
    """``POST /v1/completions``: ``prompt`` is a string, a list of one string, or a list of token ids."""

    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)
    """Return each output token's log-probability and the ``logprobs`` most likely tokens at its position (0..5;
    the chosen token's is always listed too, so up to ``logprobs + 1``)."""

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_off(cls, logprobs: Any) -> Any:
        return None if logprobs is False else logprobs

    @property
    def top_logprobs_count(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str] | list[int]) -> str | list[str] | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) and len(prompt) != 1:
            raise ValueError(f"one prompt per request, got {len(prompt)}")
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt


RequestT = TypeVar("RequestT", bound=_Generation)

_UNION_TAGS = {"str", "int", "float", "bool", "list[str]", "list[int]", "list[ContentPart]", "dict"}


def _param(loc: tuple[int | str, ...]) -> str | None:
    """``messages.0.role``-style name of the field an error is about (pydantic's union tags dropped)."""
    parts = [str(p) for p in loc if str(p) not in _UNION_TAGS and not str(p).startswith(("function-", "literal["))]
    return ".".join(parts) or None


def validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming its field."""
    err = exc.errors()[0]
    param = _param(tuple(err.get("loc", ())))
    message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return bad_request(f"{param}: {message}" if param else message, param=param)


def parse_body(raw: bytes, model: type[RequestT]) -> RequestT:
    """Parse and validate a JSON request body, raising `APIError` (400) for anything malformed."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError; RecursionError: deep nesting
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
