"""Helpers of the server tests: the bundled model in float32, and a real uvicorn server on a free port."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import uvicorn  # noqa: E402

from lattice_inference.api import Generator  # noqa: E402
from lattice_inference.models.load import LoadedModel, load_model  # noqa: E402
from lattice_inference.options import DecodeOptions  # noqa: E402
from lattice_inference.serve.app import create_app  # noqa: E402
from lattice_inference.serve.engine import Engine  # noqa: E402

MODEL_NAME = "tiny"
#: Prompts whose greedy continuations differ from one another, copy-heavy and free.
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "The quick brown fox",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "Once upon a time",
    "for i in range(10):\n    print(i)\n",
]


def load_tiny() -> LoadedModel:
    """The bundled model in float32, where every method is exactly greedy."""
    return load_model("bundled", dtype="float32")


def greedy(loaded: LoadedModel) -> Generator:
    """The reference: plain greedy decoding over the same weights."""
    return Generator(loaded.model, loaded.tokenizer, method="greedy", eos_token_ids=loaded.eos_token_ids)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running_server(
    loaded: LoadedModel,
    method: str = "ngram",
    *,
    adaptive: bool = True,
    suffix_scope: str = "tenant",
    **options: object,
) -> Iterator[tuple[str, object]]:
    """Serve ``loaded`` on a free loopback port in a thread; yield (base URL, app) and stop it afterwards.
    ``adaptive=False``: every proposal verified (drafts whatever this CPU's forwards cost)."""
    engine = Engine(loaded, DecodeOptions(method=method, adaptive=adaptive), name=MODEL_NAME, suffix_scope=suffix_scope)
    app = create_app(engine, **options)  # type: ignore[arg-type]
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def client(base: str, key: str = "none", **options: object) -> openai.OpenAI:
    """The real openai client against ``base``, without retries (a 429 must surface)."""
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, **options)  # type: ignore[arg-type]


class Raw:
    """A plain HTTP answer: status, headers and the body (parsed when JSON)."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status_code = status
        self.headers = headers
        self.text = body.decode("utf-8", "replace")

    def json(self):
        return json.loads(self.text)


def request(base: str, method: str, path: str, body: object = None, headers: dict[str, str] | None = None) -> Raw:
    """Send one request with the standard library (malformed bodies included) and return the answer."""
    url = urlsplit(base)
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
        answer = conn.getresponse()
        return Raw(answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read())
    finally:
        conn.close()
