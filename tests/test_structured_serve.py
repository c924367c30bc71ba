"""Structured output and tool calls end to end on the real default model: `response_format`, `tools` /
`tool_choice` and `logit_bias` through the real openai client (whole and streamed) equal to the Python API's plain
constrained decoding; `logit_bias` lossless under speculation; the tool-call parser; the errors."""

from __future__ import annotations

import json

import openai
import pytest

from lattice_inference import Generator
from lattice_inference.errors import ConfigError
from lattice_inference.grammar import GrammarError
from lattice_inference.models.load import load_model
from lattice_inference.tool_calls import Tool, ToolCallParser, chosen_tools, tools_grammar
from lattice_testing.json_schema import follows

from .helpers import skip_without_real_model
from .serve_harness import MODEL_NAME, client, running_server

pytest.importorskip("llguidance")
skip_without_real_model()

DOC = "Invoice INV-2044 from Northwind Traders to Contoso Ltd, dated 2026-03-14. Total due: 77.50 EUR."
INVOICE = {
    "type": "object",
    "properties": {
        "number": {"type": "string", "maxLength": 12},
        "seller": {"type": "string", "maxLength": 40},
        "total": {"type": "number"},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
    },
    "required": ["number", "seller", "total", "currency"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
BUDGET = 64


@pytest.fixture(scope="module")
def loaded():
    return load_model("smollm2", dtype="float32")


@pytest.fixture(scope="module")
def plain(loaded):
    return Generator(loaded.model, loaded.tokenizer, method="greedy", eos_token_ids=loaded.eos_token_ids)


@pytest.fixture(scope="module")
def server(loaded):
    with running_server(loaded, "ngram", adaptive=False) as (base, _):
        yield client(base)


def _format(schema):
    return {"type": "json_schema", "json_schema": {"name": "invoice", "schema": schema, "strict": True}}


def test_response_format_is_plain_constrained_decoding_and_follows_the_schema(server, plain):
    messages = [{"role": "user", "content": f"Extract the invoice as JSON.\n\n{DOC}"}]
    reference = plain.generate(plain.encode_messages(messages), BUDGET, response_format=_format(INVOICE))
    got = server.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=BUDGET, response_format=_format(INVOICE)
    )
    content = got.choices[0].message.content
    assert content == reference.text and got.usage.completion_tokens == len(reference.token_ids)
    assert reference.stop_reason == "eos" and follows(json.loads(content), INVOICE), content
    metrics = got.model_extra["speculative_metrics"]
    assert metrics["grammar_forced_tokens"] > 0 and metrics["grammar_mask_s"] > 0
    assert metrics["grammar_mask_us_per_token"] == pytest.approx(
        1e6 * metrics["grammar_mask_s"] / len(reference.token_ids)
    )
    anything = server.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=BUDGET, response_format={"type": "json_object"}
    )
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    assert anything.choices[0].message.content.startswith("{")


def test_a_required_tool_call_comes_whole_and_streamed_in_the_openai_shape(server, plain):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = server.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=BUDGET, tools=[WEATHER, TIME], tool_choice=named
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert follows(arguments, WEATHER["function"]["parameters"]), arguments
    # the Python API's plain constrained decoding of the same prompt and grammar writes exactly this call
    ids = plain.codec.chat_ids(ASK, _tools([WEATHER, TIME]))
    reference = plain.generate(
        ids, BUDGET, grammar=plain.grammar(lark=tools_grammar(_tools([WEATHER]), parallel=False))
    )
    arguments_text = call.function.arguments
    assert reference.text == f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments_text}}}\n</tool_call>'
    assert whole.usage.completion_tokens == len(reference.token_ids)
    stream = server.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=BUDGET, tools=[WEATHER, TIME], tool_choice=named, stream=True
    )
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in stream:
        for part in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"name": "", "arguments": "", "id": ""})
            entry["id"] += part.id or ""
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert list(calls) == [0] and reasons[-1] == "tool_calls"
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == arguments


def _tools(entries):
    return [Tool(e["function"]["name"], e["function"]["description"], e["function"]["parameters"]) for e in entries]


def test_required_auto_none_and_a_tool_loop(server):
    required = server.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=2 * BUDGET, tools=[WEATHER, TIME], tool_choice="required"
    )
    calls = required.choices[0].message.tool_calls
    assert calls and {c.function.name for c in calls} <= {"get_weather", "get_time"}
    auto = server.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=BUDGET, tools=[WEATHER])
    none = server.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=BUDGET, tools=[WEATHER], tool_choice="none"
    )
    bare = server.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=BUDGET)
    assert none.choices[0].message.content == bare.choices[0].message.content  # "none" leaves the tools out
    assert auto.choices[0].finish_reason in ("stop", "tool_calls", "length")
    assert auto.usage.prompt_tokens > bare.usage.prompt_tokens  # the tools were offered in the system message
    # the client answers the call and the conversation goes on
    call = calls[0]
    turn = {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]}
    answer = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "unit": "celsius"}'}
    follow = server.chat.completions.create(
        model=MODEL_NAME, messages=[*ASK, turn, answer], max_tokens=24, tools=[WEATHER, TIME]
    )
    assert follow.choices[0].message.content or follow.choices[0].message.tool_calls


def test_logit_bias_is_lossless_under_speculation_and_reaches_the_server(server, loaded, plain):
    prompt = "Repeat exactly: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat."
    ids = plain.encode(prompt, chat=True)
    unbiased = plain.generate(ids, 32)
    banned = unbiased.token_ids[3]
    bias = {banned: -100.0, unbiased.token_ids[5]: 5.0}
    reference = plain.generate(ids, 32, logit_bias=bias)
    assert reference.token_ids != unbiased.token_ids and banned not in reference.token_ids
    fast = Generator(loaded.model, loaded.tokenizer, method="ngram", adaptive=False, eos_token_ids=loaded.eos_token_ids)
    out = fast.generate(ids, 32, logit_bias=bias)
    assert out.token_ids == reference.token_ids and out.metrics.accepted_tokens > 0
    sampled = {"temperature": 0.8, "seed": 3, "logit_bias": bias}
    assert fast.generate(ids, 32, **sampled).token_ids == plain.generate(ids, 32, **sampled).token_ids
    got = server.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=32, logit_bias={str(k): v for k, v in bias.items()}
    )
    assert got.choices[0].text == plain.tokenizer.decode(reference.token_ids, skip_special_tokens=True)


def test_many_prompts_under_one_response_format_each_as_alone(loaded, plain):
    fast = Generator(loaded.model, loaded.tokenizer, method="ngram", eos_token_ids=loaded.eos_token_ids)
    prompts = [f"Extract the invoice as JSON.\n\n{DOC}", "Make up an invoice from Acme to Initech as JSON."]
    alone = [plain.generate(p, 40, chat=True, response_format=_format(INVOICE)).token_ids for p in prompts]
    many = fast.generate_many(prompts, 40, chat=True, response_format=_format(INVOICE), max_batch=2)
    assert [r.token_ids for r in many] == alone
    with pytest.raises(GrammarError, match="not both"):
        plain.generate("x", 4, grammar=plain.grammar(regex="a+"), response_format={"type": "json_object"})


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"response_format": _format({"type": "nosuch"})}, "response_format", "cannot compile"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs 'json_schema'"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, None, "cannot be combined"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias", "outside the vocabulary"),
        ({"logit_bias": {"5": 101}}, None, "must be a number in"),
        ({"logit_bias": {"x": 1}}, None, "token ids"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_it(server, body, param, message):
    with pytest.raises(openai.BadRequestError, match=message) as caught:
        server.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=4, **body)
    assert caught.value.status_code == 400
    if param is not None:
        assert caught.value.body["param"] == param
    assert server.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=2).choices  # still serving


def test_the_tool_call_parser_splits_content_and_calls_across_chunks():
    text = 'Sure.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g"}\n</tool'
    for size in (1, 3, 7, len(text)):
        parser = ToolCallParser()
        content, calls = "", []
        for i in range(0, len(text), size):
            piece, done = parser.push(text[i : i + size])
            assert "<" not in piece, "a possible tag is held back"
            content, calls = content + piece, calls + done
        rest, more = parser.flush()
        assert content + rest == "Sure." and [(c.name, c.arguments) for c in calls + more] == [
            ("f", '{"a": 1}'),
            ("g", "{}"),
        ]
    bad = ToolCallParser()
    assert bad.push("<tool_call>not json</tool_call> ok") == ("<tool_call>not json</tool_call> ok", [])
    assert chosen_tools([], None) == ("none", [])
    with pytest.raises(ConfigError, match="same name"):
        chosen_tools(_tools([WEATHER, WEATHER]), "auto")


def test_the_cli_takes_a_json_schema_a_gbnf_grammar_and_a_regex(tmp_path, capsys, plain):
    from lattice_inference.cli import main

    schema, gbnf = tmp_path / "invoice.json", tmp_path / "yes-no.gbnf"
    schema.write_text(json.dumps(INVOICE))
    gbnf.write_text('root ::= "The answer is " ("yes" | "no") "."\n')
    prompt = f"Extract the invoice as JSON.\n\n{DOC}"
    base = ["generate", "--model", "smollm2", "--dtype", "float32", "--max-new-tokens", "48", "--method"]
    assert main([*base, "ngram", "--fixed-draft", "--prompt", prompt, "--json-schema", str(schema), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    reference = plain.generate(prompt, 48, chat=True, grammar=plain.grammar(json_schema=INVOICE))
    assert out["token_ids"] == reference.token_ids and follows(json.loads(out["text"]), INVOICE)
    assert main([*base, "greedy", "--prompt", "Is the sky blue?", "--grammar", str(gbnf), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("The answer is yes.", "The answer is no.")
    regex = "(one|two|three)( (one|two|three))*"
    assert main([*base, "greedy", "--prompt", "Count to three.", "--regex", regex, "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["text"].split()) <= {"one", "two", "three"}
    (tmp_path / "bad.json").write_text("{bad")
    assert main([*base, "greedy", "--prompt", "x", "--json-schema", str(tmp_path / "bad.json")]) == 2
    assert "is not a JSON schema" in capsys.readouterr().err


def test_a_template_with_a_tools_section_gets_the_tools_and_a_lossless_constrained_call():
    """Qwen2.5's own template (a real GGUF file) renders the tools; its added ``<tool_call>`` token is text to the
    grammar (llguidance once allowed it in a mask and refused it when consumed); prompt lookup emits plain
    constrained decoding's call."""
    from lattice_inference.kernels import native_ops
    from lattice_inference.tool_calls import template_has_tools
    from lattice_testing.real_files import missing, real_file

    path = real_file("qwen2.5-coder-0.5b")
    if path is None or native_ops.quant() is None:
        pytest.skip(missing("qwen2.5-coder-0.5b") if path is None else "our quantized products do not run here")
    qwen = load_model(str(path), dtype="auto")
    assert template_has_tools(qwen.tokenizer.chat_template)
    common = {"eos_token_ids": qwen.eos_token_ids}
    plain_q = Generator(qwen.model, qwen.tokenizer, method="greedy", **common)
    fast_q = Generator(qwen.model, qwen.tokenizer, method="ngram", adaptive=False, **common)
    ids = plain_q.codec.chat_ids(ASK, _tools([WEATHER, TIME]))
    assert '"name": "get_time"' in qwen.tokenizer.decode(ids)  # offered through the template's <tools> section
    source = tools_grammar(_tools([WEATHER, TIME]))
    tag = qwen.tokenizer.convert_tokens_to_ids("<tool_call>")
    assert plain_q.grammar(lark=source).state().valid_prefix([tag, 198]) == 2  # the tag token, then "\n"
    reference = plain_q.generate(ids, 48, grammar=plain_q.grammar(lark=source))
    out = fast_q.generate(ids, 48, grammar=fast_q.grammar(lark=source))
    assert out.token_ids == reference.token_ids and out.metrics.grammar_forced_tokens > 0
    parser = ToolCallParser()
    content, calls = parser.push(reference.text)
    rest, more = parser.flush()
    (call,) = calls + more
    assert content + rest == "" and call.name in ("get_weather", "get_time")
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.name]
    assert follows(json.loads(call.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("model", ["smollm2", "bundled"])
def test_every_method_under_a_grammar_on_two_architectures(model, loaded):
    """Every method (MTP heads included: SmolLM2's shipped one, the bundled Qwen3.5 hybrid's own), greedy and
    seeded, emits plain constrained decoding's tokens."""
    from lattice_inference.api import mtp_head_for
    from lattice_inference.options import METHODS, needs_mtp_head

    lm = loaded if model == "smollm2" else load_model("bundled", dtype="float32")
    common = {"eos_token_ids": lm.eos_token_ids}
    plain_m = Generator(lm.model, lm.tokenizer, method="greedy", **common)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "n": {"type": "integer"}}}
    prompt = f"Extract the seller and the total as JSON.\n\n{DOC}" if model == "smollm2" else "def add(a, b):\n"
    ids = plain_m.encode(prompt, chat=model == "smollm2")
    head = mtp_head_for(lm, 3)
    target = plain_m.decoder.target  # one target: one self-check
    fast = {
        method: Generator(
            lm.model,
            lm.tokenizer,
            method=method,
            adaptive=False,
            target=target,
            **common,
            **({"mtp_head": head, "draft_length": 3} if needs_mtp_head(method) else {}),
        )
        for method in METHODS
        if method != "greedy"
    }
    seeded = {"temperature": 0.8, "seed": 11}  # on SmolLM2 test_grammar samples under a grammar already
    for kw in ({}, seeded) if model == "bundled" else ({},):
        reference = plain_m.generate(ids, 32, grammar=plain_m.grammar(json_schema=schema), **kw)
        for method, gen in fast.items():
            out = gen.generate(ids, 32, grammar=gen.grammar(json_schema=schema), **kw)
            assert out.token_ids == reference.token_ids, (model, method, kw)
