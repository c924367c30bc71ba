"""`lattice serve` under load: concurrent clients, a bounded queue (429), disconnects, and matching metrics."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .serve_harness import MODEL_NAME, PROMPTS, client, greedy, load_tiny, request, running_server

MAX_TOKENS = 8
CLIENTS, REQUESTS = 32, 3


@pytest.fixture(scope="module")
def loaded():
    return load_tiny()


@pytest.fixture(scope="module")
def expected(loaded):
    """Greedy text per (prompt index, chat) at ``MAX_TOKENS``."""
    ref = greedy(loaded)
    return {(i, chat): ref.generate(p, MAX_TOKENS, chat=chat).text for i, p in enumerate(PROMPTS) for chat in (0, 1)}


def scrape(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, parsed by prometheus_client, keyed by (name, sorted labels)."""
    text = request(base, "GET", "/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def one_request(api: openai.AsyncOpenAI, prompt: int, chat: bool, stream: bool) -> tuple[str, str]:
    common = dict(model=MODEL_NAME, max_tokens=MAX_TOKENS, stream=stream)
    if chat:
        out = await api.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[prompt]}], **common)
        if not stream:
            return out.choices[0].message.content, out.choices[0].finish_reason
        chunks = [c async for c in out]
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason
    out = await api.completions.create(prompt=PROMPTS[prompt], **common)
    if not stream:
        return out.choices[0].text, out.choices[0].finish_reason
    chunks = [c async for c in out]
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


async def disconnect_mid_stream(api: openai.AsyncOpenAI) -> int:
    """Ask for a long stream, read two chunks, hang up; return the chunks read."""
    out = await api.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=1000, stream=True)
    read = 0
    async for _ in out:
        read += 1
        if read == 2:
            break
    await out.close()
    return read


def test_32_clients_3_requests_each_with_a_disconnect(loaded, expected):
    # Headroom of 2: a client may send its next request a moment before the server counts its last one done.
    with running_server(loaded, method="ngram", max_queue=CLIENTS + 2) as (base, _):

        async def run_all():
            api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)

            async def one_client(c: int):
                results = []
                for r in range(REQUESTS):
                    prompt, chat, stream = (c + r) % len(PROMPTS), (c + r) % 2 == 1, (c * 3 + r) % 2 == 0
                    results.append(((prompt, chat), await one_request(api, prompt, chat, stream)))
                return results

            outcome = await asyncio.gather(disconnect_mid_stream(api), *(one_client(c) for c in range(CLIENTS)))
            await api.close()
            return outcome

        started = time.perf_counter()
        read, *per_client = asyncio.run(run_all())
        elapsed = time.perf_counter() - started
        results = [r for rs in per_client for r in rs]
        assert read == 2 and len(results) == CLIENTS * REQUESTS
        for key, (text, finish) in results:
            assert text == expected[key], key
            assert finish in ("length", "stop")
        health = request(base, "GET", "/health").json()
        idle = {"status": "ok", "waiting": 0, "running": 0, "taking_in": 0, "prompt_rows_left": 0}
        assert health == idle | {"model": MODEL_NAME, "device": "cpu", "dtype": health["dtype"]}
        samples = scrape(base)
        info = (("device", "cpu"), ("dtype", health["dtype"]), ("model", MODEL_NAME))
        assert samples[("lattice_model_info", info)] == 1
        ok = sum(
            samples.get(("lattice_requests_total", (("endpoint", e), ("status", "200"))), 0)
            for e in ("/v1/chat/completions", "/v1/completions")
        )
        assert ok == CLIENTS * REQUESTS + 1
        assert not any(name == "lattice_requests_total" and dict(labels)["status"] == "429" for name, labels in samples)
        cancelled = samples[("lattice_generations_total", (("finish_reason", "cancelled"), ("method", "ngram")))]
        assert cancelled == 1
        # The hung-up generation stopped early: far fewer than its 1000 tokens were generated in all.
        generated = samples[("lattice_generated_tokens_total", (("method", "ngram"),))]
        assert generated < CLIENTS * REQUESTS * MAX_TOKENS + 100
        print(f"{len(results)} requests in {elapsed:.1f}s")


def test_full_queue_answers_429_and_a_hang_up_frees_the_worker(loaded, expected):
    with running_server(loaded, method="greedy", max_queue=1, max_batch=1) as (base, _):
        api = client(base)
        long = api.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=3000, stream=True)
        next(iter(long))  # running now
        waiting: dict[str, object] = {}

        def second() -> None:
            out = client(base).completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS)
            waiting["text"], waiting["done"] = out.choices[0].text, time.perf_counter()

        thread = threading.Thread(target=second)
        thread.start()
        deadline = time.monotonic() + 10
        while request(base, "GET", "/health").json()["waiting"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
        started = time.perf_counter()
        refused = request(base, "POST", "/v1/completions", body)
        assert refused.status_code == 429 and time.perf_counter() - started < 5  # at once, not after the queue
        assert refused.headers["retry-after"] == "1" and refused.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            api.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert request(base, "GET", "/metrics").status_code == 200  # answers while generating
        hung_up = time.perf_counter()
        long.close()
        thread.join(timeout=30)
        assert waiting["text"] == expected[(1, 0)]
        assert waiting["done"] - hung_up < 20  # type: ignore[operator]  (not the 3000-token run)
        samples = scrape(base)
        assert samples[("lattice_requests_total", (("endpoint", "/v1/completions"), ("status", "429")))] == 1
        assert samples[("lattice_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "429")))] == 1
        assert samples[("lattice_generations_total", (("finish_reason", "cancelled"), ("method", "greedy")))] == 1
        assert samples[("lattice_generated_tokens_total", (("method", "greedy"),))] < 1000
        assert (
            api.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS).choices[0].text
            == (expected[(1, 0)])
        )


def test_metrics_match_the_requests_made(loaded):
    with running_server(loaded, method="ngram", adaptive=False) as (base, _):  # drafts, for the draft metrics
        api = client(base)
        outs = [
            api.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=20),
            api.completions.create(
                model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=12, extra_body={"speculative": {"method": "greedy"}}
            ),
            api.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=10
            ),
        ]
        chunks = list(
            api.completions.create(
                model=MODEL_NAME, prompt=PROMPTS[5], max_tokens=9, stream=True, stream_options={"include_usage": True}
            )
        )
        with pytest.raises(openai.BadRequestError):
            api.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=10**6)
        assert request(base, "GET", "/health").status_code == 200
        samples = scrape(base)

    def value(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    assert value("lattice_requests_total", endpoint="/v1/completions", status="200") == 3
    assert value("lattice_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert value("lattice_requests_total", endpoint="/v1/completions", status="400") == 1
    assert value("lattice_requests_total", endpoint="/health", status="200") == 1
    metrics = [o.speculative_metrics for o in outs] + [chunks[-2].speculative_metrics]
    usage = [o.usage for o in outs] + [chunks[-1].usage]
    by_method = Counter()
    for m, u in zip(metrics, usage, strict=True):
        by_method[m["method"]] += u.completion_tokens
    assert value("lattice_generated_tokens_total", method="ngram") == by_method["ngram"] == 20 + 10 + 9
    assert value("lattice_generated_tokens_total", method="greedy") == by_method["greedy"] == 12
    assert value("lattice_prompt_tokens_total") == sum(u.prompt_tokens for u in usage)
    assert value("lattice_time_to_first_token_seconds_count", endpoint="/v1/completions") == 3
    assert value("lattice_request_latency_seconds_count", endpoint="/v1/chat/completions") == 1
    ngram = [m for m in metrics if m["method"] == "ngram"]
    drafted = sum(m["drafted_tokens"] for m in ngram)
    accepted = sum(m["accepted_tokens"] for m in ngram)
    assert value("lattice_draft_tokens_total", method="ngram") == drafted > 0
    assert value("lattice_draft_acceptance_rate", method="ngram") == pytest.approx(accepted / drafted)
    drafts = sum(m["drafts"] for m in ngram)
    assert value("lattice_mean_acceptance_length", method="ngram") == pytest.approx(1 + accepted / drafts)
    assert value("lattice_queue_depth") == 0
    assert value("lattice_prompts_taking_in") == value("lattice_prompt_rows_left") == 0


def test_an_error_in_one_request_ends_only_that_request(loaded, expected, monkeypatch):
    from lattice_inference.serve.engine import Reply

    original = Reply.delta

    def delta(self, chunk):
        if self.job.max_tokens == 7:  # the doomed request
            raise RuntimeError("boom")
        return original(self, chunk)

    monkeypatch.setattr(Reply, "delta", delta)
    with running_server(loaded, method="ngram", max_batch=4) as (base, _):

        async def run_both():
            api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
            doomed = api.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=7)
            fine = api.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS)
            outcome = await asyncio.gather(doomed, fine, return_exceptions=True)
            await api.close()
            return outcome

        doomed, fine = asyncio.run(run_both())
        assert isinstance(doomed, openai.InternalServerError) and "boom" in str(doomed)
        assert fine.choices[0].text == expected[(1, 0)]
        assert request(base, "GET", "/health").json()["running"] == 0  # the worker lives on
        assert client(base).completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS)
