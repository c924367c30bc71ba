"""OpenAI response bodies (chat and text completions, whole or as stream chunks) and the SSE response."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import anyio
from starlette.types import Receive, Scope, Send

from lattice_inference.serve.engine import Finish, LogprobEntry
from lattice_inference.tool_calls import ToolCall


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", "surrogatepass"))


class CompletionFormat:
    """Builds one request's bodies: ``chat`` (``chat.completion``) or text (``text_completion``); ``logprobs``:
    whether the request asked for log-probabilities (``choices[].logprobs`` is then an object, else null)."""

    def __init__(self, chat: bool, model: str, logprobs: bool = False) -> None:
        self.chat = chat
        self.model = model
        self.logprobs = logprobs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._calls_sent = 0  # tool calls streamed so far (each chunk's calls are indexed from here)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _choice(
        self, text: str | None, finish_reason: str | None, *, whole: bool, entries: list[LogprobEntry] | None = None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if not self.chat:
            choice["text"] = text or ""
        elif whole:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["delta"] = {} if text is None else {"content": text}
        logprobs = self._logprobs(entries) if self.logprobs and entries is not None else None
        return {**choice, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs(self, entries: list[LogprobEntry]) -> dict[str, Any]:
        """OpenAI's ``logprobs`` object: chat's ``content`` list, or the completions' parallel lists (whose
        ``top_logprobs`` always hold the chosen token too)."""
        if self.chat:
            content = [
                {
                    "token": e.token,
                    "logprob": e.logprob,
                    "bytes": _bytes(e.token),
                    "top_logprobs": [{"token": t, "logprob": v, "bytes": _bytes(t)} for t, v in e.top],
                }
                for e in entries
            ]
            return {"content": content, "refusal": None}
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{**dict(e.top), e.token: e.logprob} for e in entries],
            "text_offset": [e.offset for e in entries],
        }

    @staticmethod
    def usage(finish: Finish) -> dict[str, Any]:
        """OpenAI's ``usage`` object (``cached_tokens``: prompt tokens the prefill kept from the same tenant's
        earlier requests, see ``--no-prefix-cache``; the prediction's tokens drafted and accepted, and drafted,
        verified and refused, where the request sent a ``prediction``)."""
        return {
            "prompt_tokens": finish.prompt_tokens,
            "completion_tokens": finish.completion_tokens,
            "total_tokens": finish.prompt_tokens + finish.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": int(finish.metrics.get("cached_prompt_tokens", 0))},
            "completion_tokens_details": {
                "accepted_prediction_tokens": int(finish.metrics.get("accepted_prediction_tokens", 0)),
                "rejected_prediction_tokens": int(finish.metrics.get("rejected_prediction_tokens", 0)),
            },
        }

    def whole(
        self,
        text: str,
        finish: Finish,
        entries: list[LogprobEntry] | None = None,
        tool_calls: Sequence[ToolCall] = (),
    ) -> dict[str, Any]:
        """The non-streamed response, with the acceptance metrics in ``speculative_metrics`` (``tool_calls``: the
        calls the output made; the message's ``content`` is then null where no text is left beside them)."""
        choice = self._choice(text, finish.reason, whole=True, entries=entries or [])
        if tool_calls:
            choice["message"]["content"] = text or None
            choice["message"]["tool_calls"] = [call.as_openai() for call in tool_calls]
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        return {**body, "usage": self.usage(finish), "speculative_metrics": finish.metrics}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", choices)

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role, as OpenAI's do."""
        if not self.chat:
            return None
        chunk = self._chunk([self._choice(None, None, whole=False)])
        chunk["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return chunk

    def text_chunk(
        self, text: str, entries: list[LogprobEntry] | None = None, drafted: list[tuple[int, int]] | None = None
    ) -> dict[str, Any]:
        """A chunk carrying newly released text (and the log-probabilities of the tokens it completes; where asked,
        ``speculative.drafted``: the round's spans of text from accepted drafts)."""
        chunk = self._chunk([self._choice(text, None, whole=False, entries=entries or [])])
        if drafted is not None:
            chunk["speculative"] = {"drafted": [list(span) for span in drafted]}
        return chunk

    def tool_calls_chunk(self, calls: Sequence[ToolCall]) -> dict[str, Any]:
        """A chunk with tool calls the output completed, each whole (name and arguments), indexed as OpenAI's
        streams index them (the clients join the chunks of one index)."""
        chunk = self._chunk([self._choice(None, None, whole=False)])
        first = self._calls_sent
        self._calls_sent += len(calls)
        chunk["choices"][0]["delta"] = {"tool_calls": [c.as_openai(first + i) for i, c in enumerate(calls)]}
        return chunk

    def finish_chunk(self, finish: Finish) -> dict[str, Any]:
        """The chunk with the finish reason (and the acceptance metrics)."""
        return {**self._chunk([self._choice(None, finish.reason, whole=False)]), "speculative_metrics": finish.metrics}

    def usage_chunk(self, finish: Finish) -> dict[str, Any]:
        """``stream_options.include_usage``: a last chunk with no choices and the usage."""
        return {**self._chunk([]), "usage": self.usage(finish)}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event ``data: ...`` line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


class EventStreamResponse:
    """Streams ``events`` as ``text/event-stream``; calls ``on_disconnect`` as soon as the client goes away.

    Starlette's own streaming response only notices a gone client when a write fails, which can be many
    rounds later while stop-string text is held back; this one listens for the disconnect message meanwhile.
    """

    def __init__(self, events: AsyncGenerator[bytes, None], on_disconnect: Callable[[], None]) -> None:
        self.events = events
        self.on_disconnect = on_disconnect
        self.status_code = 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        async with anyio.create_task_group() as group:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.on_disconnect()
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                async for event in self.events:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                self.on_disconnect()
            finally:
                group.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    await self.events.aclose()
