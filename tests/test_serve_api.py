"""`lattice serve` through the real openai client: outputs equal `Generator`'s, stop strings, usage, errors, auth."""

from __future__ import annotations

import openai
import pytest

from .serve_harness import MODEL_NAME, PROMPTS, client, request, running_server

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server(loaded):
    with running_server(loaded, method="ngram", max_queue=4, max_body=64 * 1024) as (base, _app):
        yield base


def chat_messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def stream_text(chunks, chat: bool) -> tuple[str, list]:
    chunks = list(chunks)
    if chat:
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks


@pytest.mark.parametrize(
    ("method", "stream"), [("greedy", False), ("ngram", False), ("ngram", True), ("mtp", True), ("ngram+mtp", False)]
)
def test_chat_equals_generator(server, reference, method, stream):
    prompt = PROMPTS[0]
    want = reference.generate(prompt, MAX_TOKENS, chat=True)
    api = client(server)
    kwargs = dict(model=MODEL_NAME, messages=chat_messages(prompt), max_tokens=MAX_TOKENS, temperature=0, seed=1)
    extra = {"speculative": {"method": method, "max_draft": 6, "adaptive": False}}  # every proposal verified
    if stream:
        out = api.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}, extra_body=extra
        )
        text, chunks = stream_text(out, chat=True)
        assert chunks[0].choices[0].delta.role == "assistant"
        finish, usage, metrics = chunks[-2].choices[0].finish_reason, chunks[-1].usage, chunks[-2].speculative_metrics
        assert chunks[-1].choices == []
    else:
        out = api.chat.completions.create(**kwargs, extra_body=extra)
        text, finish, usage, metrics = out.choices[0].message.content, out.choices[0].finish_reason, out.usage, None
        metrics = out.speculative_metrics
        assert out.object == "chat.completion" and out.model == MODEL_NAME
    assert text == want.text
    assert finish == "length"
    assert usage.completion_tokens == len(want.token_ids) == MAX_TOKENS
    assert usage.prompt_tokens == len(reference.encode(prompt, chat=True))
    assert metrics["method"] == method and metrics["new_tokens"] == MAX_TOKENS
    if method != "greedy":
        assert metrics["drafted_tokens"] > 0


@pytest.mark.parametrize(("prompt", "stream"), [(PROMPTS[1], True), (PROMPTS[3], False)])
def test_completions_equal_generator(server, reference, prompt, stream):
    want = reference.generate(prompt, MAX_TOKENS)
    api = client(server)
    out = api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, stream=stream)
    if stream:
        text, chunks = stream_text(out, chat=False)
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        text = out.choices[0].text
        assert out.object == "text_completion" and out.usage.completion_tokens == MAX_TOKENS
    assert text == want.text


def test_completions_accept_token_ids_and_default_budget(server, reference):
    ids = reference.encode(PROMPTS[1])
    out = client(server).completions.create(model=MODEL_NAME, prompt=ids)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 16
    assert out.choices[0].text == reference.generate(ids, 16).text


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_output_and_ends_generation(server, reference, stream):
    want = reference.generate(PROMPTS[2], 32).text
    stop = want[12:15]
    cut = want[: want.find(stop)]
    api = client(server)
    out = api.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=32, stop=[stop, "@@never@@"], stream=stream
    )
    if stream:
        text, chunks = stream_text(out, chat=False)
        finish = chunks[-1].choices[0].finish_reason
    else:
        text, finish = out.choices[0].text, out.choices[0].finish_reason
        assert out.usage.completion_tokens < 32
    assert (text, finish) == (cut, "stop")


def test_models_and_health(server):
    assert [m.id for m in client(server).models.list()] == [MODEL_NAME]
    assert request(server, "GET", "/health").json()["status"] == "ok"


def post(base: str, path: str, body: object, headers: dict[str, str] | None = None):
    return request(base, "POST", path, body, headers)


OK_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD_BODIES = [
    # (body, status, param)
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b"[" * 30_000, 400, None),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}', 400, "messages.0.content"),
    ({"model": MODEL_NAME, "max_tokens": 4}, 400, "messages"),
    ({**OK_CHAT, "max_tokens": "4"}, 400, "max_tokens"),
    ({**OK_CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ({**OK_CHAT, "stream": "yes"}, 400, "stream"),
    ({**OK_CHAT, "messages": []}, 400, "messages"),
    ({**OK_CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ({**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages.0.content"),
    ({**OK_CHAT, "max_tokens": 10**6}, 400, "max_tokens"),
    ({**OK_CHAT, "temperature": 2.5}, 400, "temperature"),
    ({**OK_CHAT, "temperature": -1}, 400, "temperature"),
    ({**OK_CHAT, "top_p": 0}, 400, "top_p"),
    ({**OK_CHAT, "top_p": 1.5}, 400, "top_p"),
    ({**OK_CHAT, "top_k": -1}, 400, "top_k"),
    ({**OK_CHAT, "min_p": 1.5}, 400, "min_p"),
    ({**OK_CHAT, "n": 2}, 400, "n"),
    ({**OK_CHAT, "stop": [""]}, 400, "stop"),
    ({**OK_CHAT, "stop": "x" * 1001}, 400, "stop"),
    ({**OK_CHAT, "top_logprobs": 3}, 400, None),
    ({**OK_CHAT, "speculative": {"method": "medusa"}}, 400, "speculative.method"),
    ({**OK_CHAT, "speculative": {"max_draft": 0}}, 400, "speculative.max_draft"),
    ({**OK_CHAT, "speculative": {"min_ngram": 4, "max_ngram": 2}}, 400, "speculative.min_ngram"),
    ({**OK_CHAT, "model": "gpt-4o"}, 404, "model"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_BODIES)
def test_bad_requests_get_openai_errors_and_the_next_request_works(server, body, status, param):
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if param is not None:
        assert error["param"] == param
    assert post(server, "/v1/chat/completions", OK_CHAT).status_code == 200


def test_errors_through_the_openai_client(server):
    api = client(server)
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=4)
    assert info.value.status_code == 400 and info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4, n=3)
    assert "n must be 1" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="other", prompt="x", max_tokens=4)


def test_body_over_the_limit_is_413(server):
    response = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "x" * 100_000})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_unknown_route_and_method_use_the_error_schema(server):
    assert request(server, "GET", "/v1/nothing").json()["error"]["type"] == "not_found_error"
    assert request(server, "GET", "/v1/completions").status_code == 405


def test_api_key(loaded):
    with running_server(loaded, api_key="s3cret") as (base, _):
        assert request(base, "GET", "/health").status_code == 200
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            response = post(base, "/v1/chat/completions", OK_CHAT, headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "authentication_error"
        assert request(base, "GET", "/metrics").status_code == 401
        assert request(base, "GET", "/v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client(base, key="wrong").models.list()
        api = client(base, key="s3cret")
        assert api.chat.completions.create(**OK_CHAT).choices[0].message.content is not None
        assert request(base, "GET", "/metrics", headers={"authorization": "Bearer s3cret"}).status_code == 200


@pytest.mark.parametrize(
    "argv",
    [
        ["--method", "medusa"],
        ["--draft-length", "9"],
        ["--min-ngram", "4", "--max-ngram", "2"],
        ["--max-queue", "-1"],
        ["--port", "70000"],
        ["--shutdown-timeout", "-1"],
        ["--shutdown-timeout", "inf"],
        ["--model", "/nonexistent/model"],
        ["--kv-slots", "2", "--max-batch", "4"],
    ],
)
def test_serve_command_rejects_bad_options_with_one_line(argv, capsys):
    from lattice_inference.cli import main

    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lattice: error:") and "\n" not in err


def test_prompt_filling_the_context_is_a_400(server):
    body = {"model": MODEL_NAME, "prompt": [5] * 4096, "max_tokens": 1}
    error = post(server, "/v1/completions", body).json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    body = {"model": MODEL_NAME, "prompt": [5, 99999]}
    assert post(server, "/v1/completions", body).json()["error"]["param"] == "prompt"


@pytest.mark.parametrize(("method", "stream"), [("ngram", False), ("ngram+mtp", True)])
def test_sampling_with_a_seed_equals_generator(server, reference, method, stream):
    sampling = {"temperature": 0.8, "top_p": 0.9, "seed": 7}
    want = reference.generate(PROMPTS[4], MAX_TOKENS, top_k=50, **sampling)
    out = client(server).completions.create(
        model=MODEL_NAME, prompt=PROMPTS[4], max_tokens=MAX_TOKENS, stream=stream,
        extra_body={"speculative": {"method": method}, "top_k": 50}, **sampling,
    )  # fmt: skip
    if stream:
        text, chunks = stream_text(out, chat=False)
        metrics = chunks[-1].speculative_metrics
    else:
        text, metrics = out.choices[0].text, out.speculative_metrics
    assert text == want.text
    assert metrics["seed"] == 7


@pytest.mark.parametrize(("method", "stream", "chat"), [("ngram", False, False), ("ngram+mtp", True, True)])
def test_penalties_equal_generator(server, reference, method, stream, chat):
    """OpenAI's presence/frequency penalties and vLLM's ``repetition_penalty`` extension, greedy and seeded."""
    penalties = {"presence_penalty": 0.6, "frequency_penalty": 0.4}
    sampling = {"temperature": 0.7, "seed": 3} if chat else {}
    prompt = PROMPTS[0]
    encoded = reference.encode(prompt, chat)
    want = reference.generate(encoded, MAX_TOKENS, repetition_penalty=1.3, **penalties, **sampling)
    assert want.text != reference.generate(encoded, MAX_TOKENS, **sampling).text  # the penalties change the text
    extra = {"speculative": {"method": method}, "repetition_penalty": 1.3}
    api = client(server)
    if chat:
        out = api.chat.completions.create(
            model=MODEL_NAME, messages=chat_messages(prompt), max_tokens=MAX_TOKENS, stream=stream,
            extra_body=extra, **penalties, **sampling,
        )  # fmt: skip
    else:
        out = api.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, stream=stream, extra_body=extra, **penalties
        )
    text = stream_text(out, chat)[0] if stream else out.choices[0].text
    assert text == want.text


@pytest.mark.parametrize(
    "fields",
    [{"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0}, {"repetition_penalty": -1}],
)
def test_penalties_out_of_range_are_400_naming_them(server, fields):
    with pytest.raises(openai.BadRequestError) as info:
        client(server).completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, extra_body=fields)
    assert next(iter(fields)) in str(info.value)
