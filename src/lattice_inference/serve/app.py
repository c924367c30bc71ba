"""The ASGI application: OpenAI-compatible routes over one `Engine`, a `Scheduler` with a bounded queue, metrics.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics``. With an API key, every route but ``/health`` needs ``Authorization: Bearer KEY``.

Shutdown (`Server.begin_shutdown`, called by `lattice_inference.serve.shutdown.GracefulServer` on SIGTERM/SIGINT):
new generations get 503, running and queued ones may finish until ``shutdown_timeout``; then each is ended, a
stream with an error chunk saying so and ``[DONE]``, a whole response with a 503.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from lattice_inference.devices import placement
from lattice_inference.options import MAX_BATCH, SHUTDOWN_TIMEOUT
from lattice_inference.serve.engine import Delta, Engine, Finish, GenerationJob
from lattice_inference.serve.errors import APIError
from lattice_inference.serve.metrics import ServerMetrics
from lattice_inference.serve.queue import Job, QueueFull
from lattice_inference.serve.responses import CompletionFormat, EventStreamResponse, sse
from lattice_inference.serve.scheduler import Scheduler
from lattice_inference.serve.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from lattice_inference.serve.tenants import tenant_of
from lattice_inference.tool_calls import Tool

DEFAULT_MAX_BODY = 4 * 1024 * 1024
#: Text completions without ``max_tokens`` get OpenAI's default of 16 tokens; chat gets the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class CountRequests:
    """ASGI middleware: count every HTTP request by endpoint and the status code it was answered with."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        status = 500

        async def send_status(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()


class Server:
    """The routes' shared state: the engine, its queue, the metrics, the key, the body limit and the shutdown."""

    def __init__(
        self,
        engine: Engine,
        *,
        api_key: str | Sequence[str] | None,
        max_queue: int,
        max_body: int,
        max_batch: int = MAX_BATCH,
        shutdown_timeout: float = SHUTDOWN_TIMEOUT,
    ) -> None:
        self.engine = engine
        keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
        self.api_keys = [k for k in keys if k]
        """The keys the server accepts (none: no key needed); each is a tenant of the suffix methods."""
        self.max_body = max_body
        self.metrics = ServerMetrics({"model": engine.name, **placement(engine.loaded.model)})
        self.queue = Scheduler(max_queue, max_batch, on_depth=self.metrics.set_depth)
        self.metrics.watch_intake(lambda: self.queue.taking_in)
        self.started = int(time.time())
        self.shutdown_timeout = shutdown_timeout
        self.closing = False
        """Shutdown has begun: no new generations."""
        self.expired = False
        """The shutdown timeout has passed: the generations still running were ended."""
        self._jobs: set[Job] = set()

    # -- shutdown ------------------------------------------------------------------------------------------------

    def begin_shutdown(self) -> None:
        """Refuse new generations from now on and end those still running after ``shutdown_timeout`` seconds
        (call on the event loop; a second call changes nothing)."""
        if self.closing:
            return
        self.closing = True
        asyncio.get_running_loop().call_later(self.shutdown_timeout, self._expire)

    def _expire(self) -> None:
        self.expired = True
        for job in list(self._jobs):
            job.cancel()

    def _shutdown_error(self) -> APIError:
        return APIError(
            503,
            f"the server shut down before this generation finished (--shutdown-timeout {self.shutdown_timeout:g}s)",
            code="server_shutdown",
        )

    # -- request checks ------------------------------------------------------------------------------------------

    def authorize(self, request: Request) -> str | None:
        """401 unless the request carries one of the server's keys (when it has any); returns the key (None
        where the server needs none)."""
        if not self.api_keys:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(401, "missing API key: send 'Authorization: Bearer KEY'", code="invalid_api_key")
        given = key.strip().encode()
        if not any([hmac.compare_digest(given, k.encode()) for k in self.api_keys]):  # every key, in constant time
            raise APIError(401, "incorrect API key", code="invalid_api_key")
        return key.strip()

    @staticmethod
    def check_json(request: Request) -> None:
        """415 for a body declared as anything but JSON (``application/json`` or ``application/*+json``, any
        parameters); a request without a ``Content-Type`` is read as JSON."""
        declared = request.headers.get("content-type")
        if declared is None:
            return
        media = declared.partition(";")[0].strip().lower()
        if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
            raise APIError(
                415,
                f"the request body must be JSON (Content-Type: application/json), got Content-Type {declared!r}",
                code="unsupported_media_type",
            )

    async def read_body(self, request: Request) -> bytes:
        """The request body, or 413 as soon as it is known to exceed the limit."""
        declared = request.headers.get("content-length", "")
        too_large = APIError(413, f"the request body exceeds {self.max_body} bytes", code="request_too_large")
        if declared.isdigit() and int(declared) > self.max_body:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def check_model(self, model: str) -> None:
        """404 for a model this server does not serve."""
        if model != self.engine.name:
            raise APIError(
                404,
                f"model {model!r} is not served here; this server serves {self.engine.name!r}",
                param="model",
                code="model_not_found",
            )

    # -- routes ----------------------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        joining, rows = self.queue.taking_in
        state = {
            "status": "ok",
            "waiting": self.queue.waiting,
            "running": self.queue.running,
            "taking_in": joining,
            "prompt_rows_left": rows,
        }
        return JSONResponse(state | self.metrics.info)

    async def prometheus(self, request: Request) -> Response:
        self.authorize(request)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        card = {"id": self.engine.name, "object": "model", "created": self.started, "owned_by": "lattice"}
        return JSONResponse({"object": "list", "data": [card]})

    async def chat_completions(self, request: Request) -> Any:
        return await self._endpoint(request, chat=True)

    async def completions(self, request: Request) -> Any:
        return await self._endpoint(request, chat=False)

    # -- generation ---------------------------------------------------------------------------------------------

    async def _endpoint(self, request: Request, *, chat: bool) -> Any:
        """Validate a (chat) completion request, queue its generation, and answer whole or streamed."""
        arrived = time.perf_counter()
        key = self.authorize(request)
        self.check_json(request)
        if self.closing:
            raise APIError(503, "the server is shutting down; retry on another server", code="server_shutdown")
        raw = await self.read_body(request)
        engine = self.engine
        body: ChatCompletionRequest | CompletionRequest
        tool_mode, tools = "none", list[Tool]()
        if chat:
            body = parse_body(raw, ChatCompletionRequest)
            self.check_model(body.model)
            tool_mode, tools = body.tool_mode()
            offered = [t.tool() for t in body.tools or []] if tool_mode != "none" else []  # all, even if one is named
            prompt_ids = await run_in_threadpool(engine.encode_chat, body.messages, offered)
        else:
            body = parse_body(raw, CompletionRequest)
            self.check_model(body.model)
            prompt_ids = await run_in_threadpool(engine.encode_prompt, body.prompt)
        required = tools if tool_mode == "required" else []
        parallel = not isinstance(body, ChatCompletionRequest) or body.parallel_calls
        grammar = await run_in_threadpool(engine.grammar_for, body.grammar_source(), required, parallel=parallel)
        default_max_tokens = None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
        prediction = None
        if body.prediction is not None:
            prediction = await run_in_threadpool(engine.encode_prediction, body.prediction.text(), prompt_ids)
        spec = body.speculative
        job = GenerationJob(
            prompt_ids=prompt_ids,
            max_tokens=engine.budget(
                prompt_ids, body.requested_max_tokens, default_max_tokens, "messages" if chat else "prompt"
            ),
            settings=engine.settings_for(body.speculative),
            sampling=engine.sampling_for(body.sampling_fields()),
            stops=body.stops,
            logprobs=body.top_logprobs_count,
            tenant=tenant_of(engine.suffix_scopes.mode, key, spec.scope if spec else None),
            clear_index=bool(spec and spec.clear_index),
            grammar=grammar,
            tool_mode=tool_mode,
            prediction=prediction,
            show_drafts=bool(spec and spec.show_drafts),
        )
        try:
            queued = self.queue.submit(lambda: engine.reply(job, self.metrics.observe_generation))
        except QueueFull as exc:
            raise APIError(
                429, f"the server is busy: {exc}; retry later", code="queue_full", headers={"Retry-After": "1"}
            ) from None
        self._jobs.add(queued)
        fmt = CompletionFormat(chat, engine.name, logprobs=job.logprobs is not None)
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        if body.stream:
            events = self._stream(queued, fmt, body.include_usage, endpoint, arrived)
            return EventStreamResponse(events, on_disconnect=queued.cancel)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, queued))
        try:
            whole, finish = await self._collect(queued, endpoint, arrived)
        finally:
            watcher.cancel()
            queued.cancel()  # a no-op after the end; stops the generation if this handler was cancelled
            self._jobs.discard(queued)
        if finish is None and self.expired:
            return self._shutdown_error().response()
        if finish is None:  # the client went away; nobody reads this
            return APIError(499, "the client closed the request").response()
        self.metrics.latency.labels(endpoint).observe(time.perf_counter() - arrived)
        return JSONResponse(fmt.whole(whole.text, finish, whole.logprobs, whole.tool_calls))

    async def _collect(self, queued: Job, endpoint: str, arrived: float) -> tuple[Delta, Finish | None]:
        """The whole output (text, log-probabilities and tool calls as one `Delta`) and its end."""
        whole = Delta("", 0)
        finish: Finish | None = None
        try:
            async for item in queued.results():
                if isinstance(item, Delta):
                    if not whole.tokens:
                        self.metrics.ttft.labels(endpoint).observe(time.perf_counter() - arrived)
                    whole.text += item.text
                    whole.tokens += max(item.tokens, 1)
                    whole.logprobs += item.logprobs
                    whole.tool_calls += item.tool_calls
                else:
                    finish = item
        except Exception as exc:
            raise APIError(500, f"generation failed: {type(exc).__name__}: {exc}") from exc
        return whole, finish

    async def _stream(
        self, queued: Job, fmt: CompletionFormat, include_usage: bool, endpoint: str, arrived: float
    ) -> AsyncGenerator[bytes, None]:
        first = fmt.first_chunk()
        if first is not None:
            yield sse(first)
        got_token = finished = False
        try:
            async for item in queued.results():
                if isinstance(item, Delta):
                    if not got_token:
                        got_token = True
                        self.metrics.ttft.labels(endpoint).observe(time.perf_counter() - arrived)
                    if item.text or item.logprobs or item.drafted:
                        yield sse(fmt.text_chunk(item.text, item.logprobs, item.drafted))
                    if item.tool_calls:
                        yield sse(fmt.tool_calls_chunk(item.tool_calls))
                elif isinstance(item, Finish):
                    finished = True
                    yield sse(fmt.finish_chunk(item))
                    if include_usage:
                        yield sse(fmt.usage_chunk(item))
                    self.metrics.latency.labels(endpoint).observe(time.perf_counter() - arrived)
            if not finished and self.expired:
                yield sse(self._shutdown_error().body())
        except Exception as exc:
            error = APIError(500, f"generation failed: {type(exc).__name__}: {exc}")
            yield sse(error.body())
        finally:
            queued.cancel()
            self._jobs.discard(queued)
        yield sse("[DONE]")


async def _cancel_on_disconnect(request: Request, queued: Job) -> None:
    """Cancel ``queued`` when the client disconnects (the body has been read, so only that message is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    queued.cancel()


def _json_error(status: int, message: str) -> JSONResponse:
    return APIError(status, message).response()


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _json_error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")


async def _server_error(request: Request, exc: Exception) -> Response:
    return _json_error(500, f"internal error: {type(exc).__name__}: {exc}")


@functools.cache
def webui_html() -> str:
    """The chat page (`serve/webui/index.html`: one static file, its script and style inline, no build step and no
    requests elsewhere), read once."""
    return (resources.files("lattice_inference.serve") / "webui" / "index.html").read_text(encoding="utf-8")


async def chat_page(request: Request) -> Response:
    """``GET /``: the chat page (conversation, streaming, stop, method and sampling, each answer's speed and its
    tokens from accepted drafts marked). Served without a key: it holds no data and asks for the key where the
    server wants one."""
    return HTMLResponse(webui_html())


def create_app(
    engine: Engine,
    *,
    api_key: str | Sequence[str] | None = None,
    max_queue: int = 16,
    max_body: int = DEFAULT_MAX_BODY,
    shutdown_timeout: float = SHUTDOWN_TIMEOUT,
    max_batch: int = MAX_BATCH,
    webui: bool = True,
) -> Starlette:
    """The server's ASGI app over ``engine``; ``app.state.server`` holds its scheduler (``max_batch`` generations
    at once), metrics and shutdown; ``webui``: the chat page at ``/`` (`chat_page`)."""
    server = Server(
        engine,
        api_key=api_key,
        max_queue=max_queue,
        max_body=max_body,
        max_batch=max_batch,
        shutdown_timeout=shutdown_timeout,
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncGenerator[None, None]:
        yield
        server.queue.close()

    page = [Route("/", chat_page, methods=["GET"])] if webui else []
    app = Starlette(
        routes=[
            *page,
            Route("/health", server.health, methods=["GET"]),
            Route("/metrics", server.prometheus, methods=["GET"]),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
            Route("/v1/completions", server.completions, methods=["POST"]),
        ],
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
    app.state.server = server
    app.add_middleware(CountRequests, metrics=server.metrics)
    return app


__all__ = ["Server", "create_app"]
