"""`lattice serve` under the held-out probe of issue 23: usage counts independent of load and method, neutral
values accepted, tiny temperatures, and 415 for a body that is not JSON."""

from __future__ import annotations

import os

import openai
import pytest

from lattice_inference.streaming import TextStream

from .serve_harness import MODEL_NAME, PROMPTS, client, request, running_server


@pytest.fixture(scope="module")
def server(loaded):
    with running_server(loaded, method="ngram") as (base, _app):
        yield base


def received_tokens(reference, token_ids: list[int], text: str) -> int:
    """The fewest leading tokens of plain decoding's output whose text begins with ``text``, counted here from
    the reference's tokens with the tokenizer alone."""
    for n in range(len(token_ids) + 1):
        if reference.tokenizer.decode(token_ids[:n], skip_special_tokens=True).startswith(text):
            return n
    raise AssertionError("the text is not a prefix of the reference's")


#: Speculation that verifies up to 10 tokens a round (every proposal verified) overshoots a stop string by
#: different amounts than plain decoding (one token a round); the count must not depend on it.
SETTINGS = [
    {"method": "greedy"},
    {"method": "ngram", "max_draft": 10, "adaptive": False},
    {"method": "mtp", "draft_length": 8, "adaptive": False},
    {"method": "mtp"},
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("prompt", "stop"), [(PROMPTS[0], "\n\n"), (PROMPTS[3], "Summary obj")])
def test_usage_counts_the_tokens_received_whatever_the_method(server, reference, prompt, stop, stream):
    plain = reference.generate(prompt, 49)
    assert stop in plain.text
    cut = plain.text[: plain.text.find(stop)]
    want = received_tokens(reference, plain.token_ids, cut)
    assert want < len(plain.token_ids)
    api = client(server)
    counts = set()
    for spec in SETTINGS:
        body = dict(model=MODEL_NAME, prompt=prompt, max_tokens=49, stop=[stop], temperature=0)
        if stream:
            chunks = list(
                api.completions.create(
                    **body, stream=True, stream_options={"include_usage": True}, extra_body={"speculative": spec}
                )
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            usage, metrics = chunks[-1].usage, chunks[-2].speculative_metrics
        else:
            out = api.completions.create(**body, extra_body={"speculative": spec})
            text, usage, metrics = out.choices[0].text, out.usage, out.speculative_metrics
        assert text == cut
        assert usage.completion_tokens == metrics["new_tokens"] == want, spec
        counts.add(usage.completion_tokens)
    assert counts == {want}


def test_tokens_covering_is_the_shortest_prefix(reference):
    ids = reference.generate(PROMPTS[2], 20).token_ids
    stream = TextStream(reference.tokenizer)
    stream.push(ids)
    full = stream.text
    for cut in (0, 1, len(full) // 2, len(full) - 1, len(full)):
        assert stream.tokens_covering(full[:cut]) == received_tokens(reference, ids, full[:cut])
    assert stream.tokens_covering("") == 0


NEUTRAL = [
    {"presence_penalty": 0.0, "frequency_penalty": 0.0},
    {"presence_penalty": -0.0, "frequency_penalty": 0},
    {"repetition_penalty": 1.0},
    {"repetition_penalty": 1},
    {"logprobs": False, "top_logprobs": 0.0, "best_of": 1.0},
]


@pytest.mark.parametrize("fields", NEUTRAL)
def test_neutral_values_are_off(server, reference, fields):
    out = client(server).completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=8, extra_body=fields
    )  # fmt: skip
    assert out.choices[0].text == reference.generate(PROMPTS[1], 8).text


@pytest.mark.parametrize("fields", [{"best_of": 2}, {"echo": True}, {"logprobs": "yes"}, {"presence_penalty": True}])
def test_values_that_are_not_off_are_still_refused(server, fields):
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, **fields}
    response = request(server, "POST", "/v1/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("temperature", [1e-40, 1e-38, 5e-324])
def test_a_tiny_temperature_is_the_greedy_text(server, reference, temperature):
    out = client(server).completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=12, temperature=temperature, seed=1
    )
    assert out.choices[0].text == reference.generate("Once upon a time", 12).text


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_that_is_not_json_is_415(server, content_type):
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = request(server, "POST", path, body, headers={"content-type": content_type})
        assert response.status_code == 415, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and content_type in error["message"]


JSON_TYPES = ["application/json; charset=utf-8", "APPLICATION/JSON", "application/vnd+json"]


@pytest.mark.parametrize("content_type", JSON_TYPES)
def test_json_media_types_are_accepted(server, content_type):
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
    response = request(server, "POST", "/v1/completions", body, headers={"content-type": content_type})
    assert response.status_code == 200, response.text


def test_415_through_the_openai_client(server):
    api = client(server)
    with pytest.raises(openai.APIStatusError) as info:
        api.completions.create(
            model=MODEL_NAME, prompt="x", max_tokens=2, extra_headers={"Content-Type": "text/plain"}
        )  # fmt: skip
    assert info.value.status_code == 415


def test_serve_caps_the_onednn_primitive_cache_before_loading(monkeypatch):
    """oneDNN's primitive cache (1024 JIT-compiled shapes by default) was the server's RSS growth: ``lattice serve``
    bounds it before the first forward, and leaves a value the environment sets alone."""
    import lattice_inference.models.load
    from lattice_inference.cli import build_parser
    from lattice_inference.errors import ConfigError
    from lattice_inference.serve.command import build_engine
    from lattice_inference.serve.engine import ONEDNN_CACHE_CAPACITY, cap_onednn_cache

    name = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
    monkeypatch.delenv(name, raising=False)
    seen: list[str | None] = []

    def load_model(model, dtype, device):
        seen.append(os.environ.get(name))
        raise ConfigError("not loading in this test")

    monkeypatch.setattr(lattice_inference.models.load, "load_model", load_model)
    with pytest.raises(ConfigError, match="not loading"):
        build_engine(build_parser().parse_args(["serve", "--model", "bundled"]))
    assert seen == [str(ONEDNN_CACHE_CAPACITY)]
    monkeypatch.setenv(name, "16")
    cap_onednn_cache()
    assert os.environ[name] == "16"
