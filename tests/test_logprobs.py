"""Log-probabilities from the target's verification rows: speculative equals plain decoding, logprob for logprob
(float32), greedy and seeded; the server returns them as OpenAI defines them, whole and streamed."""

from __future__ import annotations

import math

import pytest
import torch

from lattice_inference import Generator, SamplingOptions
from lattice_inference.api import mtp_head_for
from lattice_inference.decode import SpeculativeDecoder
from lattice_inference.targets.transformers import TransformersTarget
from lattice_testing.toy import toy_config, toy_model

from .helpers import OracleDrafter, TreeOracleDrafter
from .serve_harness import MODEL_NAME, PROMPTS, client, running_server

SAMPLING = [SamplingOptions(), SamplingOptions(temperature=0.9, top_p=0.95, seed=5)]


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_speculative_logprobs_equal_plain_decodings(sampling, tree):
    """On a decode-exact target (a toy Llama in float32): every drafted round's rows give plain decoding's
    log-probabilities bit for bit, chains and draft trees, greedy and seeded."""
    model = toy_model(toy_config("llama"), init_std=0.3, seed=11)
    prompt = list(range(3, 40, 3))
    plain = (
        SpeculativeDecoder(TransformersTarget(model), adaptive=False, max_draft=4)
        .start(prompt, 48, sampling, logprobs=3)
        .result()
    )
    assert plain.logprobs is not None and len(plain.logprobs) == 48
    reference = prompt + plain.token_ids
    vocab = model.config.vocab_size
    drafter = TreeOracleDrafter(reference, vocab, seed=2) if tree else OracleDrafter(reference, vocab, seed=2)
    decoder = SpeculativeDecoder(TransformersTarget(model), drafter, max_draft=6, adaptive=tree)
    out = decoder.start(prompt, 48, sampling, logprobs=3).result()
    assert out.metrics.exact and out.metrics.accepted_tokens > 0
    assert out.token_ids == plain.token_ids
    assert out.logprobs == plain.logprobs  # exact floats, the top-3 lists included
    assert [lp.token for lp in out.logprobs] == out.token_ids


def test_speculative_logprobs_on_the_bundled_model_are_close(loaded, reference):
    """The bundled hybrid's float32 verification is not bit-exact on every CPU (its self-check says so); the
    log-probabilities still agree to float32 rounding, and the tokens exactly."""
    head = mtp_head_for(loaded, 6)
    gen = Generator(
        loaded.model, loaded.tokenizer, method="mtp", draft_length=6, adaptive=False, mtp_head=head,
        eos_token_ids=loaded.eos_token_ids,
    )  # fmt: skip
    plain = reference.generate(PROMPTS[0], 40, logprobs=3)
    out = gen.generate(PROMPTS[0], 40, logprobs=3)
    assert out.token_ids == plain.token_ids and len(out.logprobs) == len(out.token_ids) > 0
    for a, b in zip(out.logprobs, plain.logprobs, strict=True):
        assert a.token == b.token and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)


def test_logprobs_are_the_models_log_softmax(loaded, reference):
    """Against an independent forward over the whole sequence (transformers' own), to float32 tolerance."""
    prompt_ids = reference.encode(PROMPTS[2])
    out = reference.generate(prompt_ids, 24, logprobs=2)
    ids = torch.tensor([prompt_ids + out.token_ids])
    with torch.no_grad():
        logits = loaded.model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    want = torch.log_softmax(logits, dim=-1)
    for i, lp in enumerate(out.logprobs):
        assert math.isclose(lp.logprob, want[i, lp.token].item(), abs_tol=1e-4)
        assert [t for t, _ in lp.top] == want[i].topk(2).indices.tolist()
        assert lp.top[0][1] >= lp.top[1][1] and lp.top[0][0] == lp.token  # greedy: the chosen token is the top one
    assert reference.generate(prompt_ids, 4).logprobs is None


@pytest.fixture(scope="module")
def server(loaded):
    with running_server(loaded, method="ngram") as (base, _app):
        yield base


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("spec", [{"method": "greedy"}, {"method": "mtp", "draft_length": 6, "adaptive": False}])
def test_chat_logprobs(server, reference, stream, spec):
    messages = [{"role": "user", "content": PROMPTS[1]}]
    want = reference.generate(PROMPTS[1], 20, chat=True, logprobs=3)
    api = client(server)
    common = dict(model=MODEL_NAME, messages=messages, max_tokens=20, logprobs=True, top_logprobs=3)
    if stream:
        chunks = list(
            api.chat.completions.create(
                **common, stream=True, stream_options={"include_usage": True}, extra_body={"speculative": spec}
            )
        )
        content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        out = api.chat.completions.create(**common, extra_body={"speculative": spec})
        content, text, usage = out.choices[0].logprobs.content, out.choices[0].message.content, out.usage
    assert text == want.text
    assert len(content) == usage.completion_tokens == len(want.token_ids)
    assert "".join(e.token for e in content) == text
    exact = spec["method"] == "greedy"  # the bundled hybrid's verification rows agree to rounding (see above)
    for entry, lp in zip(content, want.logprobs, strict=True):
        got = [entry.logprob, *(t.logprob for t in entry.top_logprobs)]
        expected = [lp.logprob, *(v for _, v in lp.top)]
        assert (
            got == expected
            if exact
            else all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(got, expected, strict=True))
        )
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 3


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_stop_at_the_stop_string(server, reference, stream):
    plain = reference.generate(PROMPTS[0], 40, logprobs=2)
    stop = "\n\n"
    cut = plain.text[: plain.text.find(stop)]
    api = client(server)
    common = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=40, logprobs=2, stop=stop)
    spec = {"speculative": {"method": "ngram", "max_draft": 10, "adaptive": False}}
    if stream:
        chunks = list(api.completions.create(**common, stream=True, extra_body=spec))
        parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for p in parts for t in p.tokens]
        values = [v for p in parts for v in p.token_logprobs]
        tops = [d for p in parts for d in p.top_logprobs]
        offsets = [o for p in parts for o in p.text_offset]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        count = chunks[-1].speculative_metrics["new_tokens"]
    else:
        out = api.completions.create(**common, extra_body=spec)
        lp = out.choices[0].logprobs
        tokens, values, tops, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
        text, count = out.choices[0].text, out.usage.completion_tokens
    assert text == cut
    assert len(tokens) == count < len(plain.token_ids)
    assert all(math.isclose(a, b.logprob, abs_tol=1e-4) for a, b in zip(values, plain.logprobs[:count], strict=True))
    assert offsets == sorted(offsets) and offsets[0] == 0
    for token, value, top in zip(tokens, values, tops, strict=True):
        assert top[token] == value and 2 <= len(top) <= 3


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/chat/completions", {"top_logprobs": 2}),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}),
        ("/v1/completions", {"logprobs": 6}),
        ("/v1/completions", {"logprobs": True}),
    ],
)
def test_bad_logprobs_are_400(server, path, fields):
    from .serve_harness import request

    body = {"model": MODEL_NAME, "max_tokens": 2, **fields}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    response = request(server, "POST", path, body)
    assert response.status_code == 400, response.text
