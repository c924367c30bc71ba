"""`lattice serve` with continuous batching on the real model: concurrent requests share forwards, and each answer
(greedy or seeded, streamed or not, with stop strings and log-probabilities) is what it is when served alone."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from lattice_inference.models.load import load_model

from .helpers import skip_without_real_model
from .serve_harness import MODEL_NAME, running_server

skip_without_real_model()

QUESTIONS = [
    "List the planets of the solar system.",
    "What is the capital of France? Answer in one sentence.",
    "Repeat after me: the cat sat on the mat, the cat sat on the mat.",
    "Write a haiku about the sea.",
    "Name three primary colours.",
    "Explain what a prime number is.",
]


@pytest.fixture(scope="module")
def loaded():
    return load_model("smollm2", dtype="float32")


def _request(i: int) -> dict:
    body: dict = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": QUESTIONS[i]}],
        "max_tokens": 24 + 4 * i,
    }
    if i % 2:
        body |= {"temperature": 0.8, "seed": 100 + i}
    if i == 2:
        body["stop"] = ["mat,"]
    if i == 3:
        body |= {"logprobs": True, "top_logprobs": 2}
    return body


async def _ask(api: openai.AsyncOpenAI, i: int, stream: bool) -> tuple[str, str, object]:
    if not stream:
        out = await api.chat.completions.create(**_request(i))
        choice = out.choices[0]
        logprobs = None if choice.logprobs is None else [t.logprob for t in choice.logprobs.content or []]
        return choice.message.content or "", choice.finish_reason, logprobs
    chunks = [c async for c in await api.chat.completions.create(**_request(i), stream=True)]
    return (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
        chunks[-1].choices[0].finish_reason,
        None,
    )


def _serve_all(loaded, max_batch: int, concurrent: bool) -> tuple[list[tuple[str, str, object]], object]:
    with running_server(loaded, method="ngram", max_batch=max_batch) as (base, app):

        async def run() -> list[tuple[str, str, object]]:
            api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
            try:
                asks = [_ask(api, i, stream=i == 4) for i in range(len(QUESTIONS))]
                if concurrent:
                    return list(await asyncio.gather(*asks))
                return [await ask for ask in asks]
            finally:
                await api.close()

        return asyncio.run(run()), app.state.server.queue  # type: ignore[attr-defined]


def test_concurrent_requests_share_forwards_and_answer_as_alone(loaded):
    alone, _ = _serve_all(loaded, max_batch=1, concurrent=False)
    together, scheduler = _serve_all(loaded, max_batch=4, concurrent=True)
    assert together == alone
    assert scheduler.batched_rows > 0  # rows of several requests did share forwards
    assert alone[2][1] == "stop" and alone[3][2]


def test_a_short_request_finishes_beside_a_long_one(loaded):
    """With room in the batch, a request that arrives behind a long one runs beside it, not after it."""
    with running_server(loaded, method="ngram", max_batch=2) as (base, _):

        async def run() -> tuple[str, float, float]:
            api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
            started = asyncio.Event()

            async def read_long() -> float:
                long = await api.chat.completions.create(
                    model=MODEL_NAME,
                    messages=[{"role": "user", "content": "Tell me a long story about a dragon."}],
                    max_tokens=300,
                    stream=True,
                )
                async for _ in long:
                    started.set()
                return time.perf_counter()

            try:
                reader = asyncio.create_task(read_long())
                await started.wait()
                short = await api.chat.completions.create(
                    model=MODEL_NAME, messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=8
                )
                short_done = time.perf_counter()
                return short.choices[0].message.content or "", short_done, await reader
            finally:
                await api.close()

        text, short_done, long_done = asyncio.run(run())
    assert text and short_done < long_done


def test_a_long_prompt_is_taken_in_by_chunks_beside_a_stream(loaded, monkeypatch):
    """A long document arriving while another client streams joins by chunks (``/health`` shows it taking in),
    the stream keeps moving, and both answers are what each is served alone."""
    from lattice_inference import batching

    from .serve_harness import request

    monkeypatch.setattr(batching, "PROMPT_CHUNK_MAX", 32)
    document = " ".join(QUESTIONS) * 12
    bodies = [
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}]},
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"{document}\nWhich question is first?"}]},
    ]
    bodies[0]["max_tokens"], bodies[1]["max_tokens"] = 120, 12
    with running_server(loaded, method="ngram", max_batch=2, suffix_scope="request") as (base, _):
        alone = [request(base, "POST", "/v1/chat/completions", b).json()["choices"][0]["message"] for b in bodies]
        seen: list[dict] = []

        async def run() -> list[str]:
            api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
            streaming = asyncio.Event()

            async def stream() -> str:
                chunks = await api.chat.completions.create(**bodies[0], stream=True)
                text = []
                async for chunk in chunks:
                    streaming.set()
                    text.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
                return "".join(text)

            async def watch() -> None:
                while not done.is_set():
                    seen.append(await asyncio.to_thread(lambda: request(base, "GET", "/health").json()))

            done = asyncio.Event()
            reader, watcher = asyncio.create_task(stream()), asyncio.create_task(watch())
            await streaming.wait()
            long = await api.chat.completions.create(**bodies[1])
            text = await reader
            done.set()
            await watcher
            await api.close()
            return [text, long.choices[0].message.content or ""]

        together = asyncio.run(run())
    assert together == [m["content"] for m in alone]
    assert any(h["taking_in"] == 1 and h["prompt_rows_left"] > 0 for h in seen)
