"""Structured output on the real default model: every method emits token for token what plain constrained decoding
emits (greedy and seeded; drafts accepted whole, cut by the grammar, rejected by the model, forced by the grammar;
alone and in a batch), the outputs parse and follow their schema, and what the engine cannot compile is a clear
error."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import numpy as np
import pytest
import torch

from lattice_inference import Generator
from lattice_inference.batching import Driver
from lattice_inference.grammar import GrammarError
from lattice_testing.json_schema import follows

from .helpers import skip_without_real_model

pytest.importorskip("llguidance")
skip_without_real_model()

DOC = (
    "Maria Lopez is a 34 year old engineer from Madrid. She knows Python, Rust and SQL, and she is a senior "
    "developer. Maria Lopez lives in Madrid. Her colleague Tom Berg, 29, from Oslo, knows Go."
)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "skills": {"type": "array", "items": {"type": "string"}},
        "level": {"enum": ["junior", "senior"]},
    },
    "required": ["name", "age", "city", "skills", "level"],
    "additionalProperties": False,
}
SCHEMAS = {
    "person": PERSON,
    "people": {"type": "object", "properties": {"people": {"type": "array", "items": PERSON}}, "required": ["people"]},
    "optional": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "email": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "home": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                },
                "required": ["name", "home"],
            },
            "confidence": {"type": "number"},
        },
        "required": ["person", "confidence"],
    },
}
PROMPTS = {
    "person": f"Extract the first person as JSON.\n\n{DOC}",
    "people": f"List every person in this text as JSON.\n\n{DOC}",
    "optional": f"Give Maria's contact card as JSON.\n\n{DOC}",
    "nested": f"Who is the senior developer, and where does she live? Answer in JSON.\n\n{DOC}",
}
BUDGET = 40
SENTENCE = r"(Maria|Tom) is from (Madrid|Oslo)\. [A-Za-z ,.]{0,80}"


@pytest.fixture(scope="module")
def generators(smollm2, smollm2_generators):
    """Over ``load_model("smollm2", dtype="float32")``: ``greedy`` and ``ngram`` (``adaptive=False``) as the other
    modules on it build them, shared with them (conftest), and ``suffix``, this module's own."""
    loaded = smollm2
    common = {"eos_token_ids": loaded.eos_token_ids}
    return {
        "greedy": smollm2_generators["greedy"],
        "ngram": smollm2_generators["ngram"],
        "suffix": Generator(loaded.model, loaded.tokenizer, method="suffix", **common),
    }


@pytest.fixture(scope="module")
def ngram_outputs():
    """Prompt lookup's greedy generations under each schema (`ngram_output`), by schema name."""
    return {}


def ngram_output(generators, ngram_outputs, name: str):
    """``generators["ngram"]``'s greedy generation for ``PROMPTS[name]`` under ``SCHEMAS[name]`` (``BUDGET`` tokens),
    made once per module and checked by each test that needs it (``adaptive=False``: its drafts depend on the
    prompt and the output alone, so a second generation would repeat the first exactly)."""
    if name not in ngram_outputs:
        fast = generators["ngram"]
        grammar = fast.grammar(json_schema=SCHEMAS[name])
        ngram_outputs[name] = fast.generate(PROMPTS[name], BUDGET, chat=True, grammar=grammar)
    return ngram_outputs[name]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_method_emits_plain_constrained_decoding_and_the_output_follows_its_schema(
    generators, ngram_outputs, name
):
    plain = generators["greedy"]
    grammar = plain.grammar(json_schema=SCHEMAS[name])
    reference = plain.generate(PROMPTS[name], BUDGET, chat=True, grammar=grammar)
    assert reference.metrics.drafted_tokens == 0  # plain decoding drafts nothing, not even forced tokens
    if reference.stop_reason == "eos":
        assert follows(json.loads(reference.text), SCHEMAS[name]), reference.text
    suffix = generators["suffix"]
    outputs = {
        "ngram": ngram_output(generators, ngram_outputs, name),
        "suffix": suffix.generate(PROMPTS[name], BUDGET, chat=True, grammar=suffix.grammar(json_schema=SCHEMAS[name])),
    }
    for method, out in outputs.items():
        assert out.token_ids == reference.token_ids, (name, method)
        assert out.stop_reason == reference.stop_reason
        assert out.metrics.accepted_tokens > 0 and out.metrics.grammar_mask_s > 0
    for seed in (0,):  # sampled, the same seed: the same tokens
        kw = {"temperature": 0.9, "top_p": 0.95, "seed": seed}
        alone = plain.generate(PROMPTS[name], BUDGET, chat=True, grammar=grammar, **kw)
        fast = generators["ngram"]
        out = fast.generate(PROMPTS[name], BUDGET, chat=True, grammar=fast.grammar(json_schema=SCHEMAS[name]), **kw)
        assert out.token_ids == alone.token_ids, (name, seed)


def test_drafts_are_cut_by_the_grammar_forced_tokens_drafted_and_the_model_rejects_some(generators, ngram_outputs):
    """An unconstrained answer drafts prose the grammar forbids (cut, never verified); the grammar's own fixed
    spans are drafted where the drafter has nothing (always accepted); and the model still rejects drafted
    tokens the grammar allows: every case, with the output equal to plain constrained decoding."""
    prompt = PROMPTS["people"]
    reference = generators["greedy"].generate(
        prompt, 48, chat=True, grammar=generators["greedy"].grammar(regex=SENTENCE)
    )
    assert re.fullmatch(SENTENCE, reference.text), reference.text
    fast = generators["ngram"]
    out = fast.generate(prompt, 48, chat=True, grammar=fast.grammar(regex=SENTENCE))
    assert out.token_ids == reference.token_ids
    assert out.metrics.grammar_cut_tokens > 0  # the document's own words after "Maria" ("Lopez ...") are cut
    assert SCHEMAS["person"] is PERSON
    person = ngram_output(generators, ngram_outputs, "person")  # under PERSON, as generated above
    m = person.metrics
    assert m.grammar_forced_tokens > 0  # '{"name":"' and the later keys are forced
    assert m.grammar_spelled_tokens > 0  # '":"' after a key: forced bytes, drafted as spelled
    assert m.drafted_tokens > m.accepted_tokens  # the model rejected some drafted tokens


def test_a_grammar_that_ends_stops_at_eos_and_a_batch_answers_each_request_as_alone(generators):
    fast, plain = generators["ngram"], generators["greedy"]
    short = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    out = fast.generate(PROMPTS["person"], BUDGET, chat=True, grammar=fast.grammar(json_schema=short))
    assert out.stop_reason == "eos" and json.loads(out.text)["ok"] in (True, False)
    names = list(SCHEMAS)
    alone = [plain.generate(PROMPTS[n], 32, chat=True, grammar=plain.grammar(json_schema=SCHEMAS[n])) for n in names]
    decoder = fast.decoder
    gens = [
        decoder.new_generation(fast.encode(PROMPTS[n], True), 32, grammar=fast.grammar(json_schema=SCHEMAS[n]).state())
        for n in names
    ]
    driver = Driver(3)
    waiting = list(gens)
    while waiting or len(driver):
        while waiting and driver.has_room:
            driver.admit(decoder, waiting.pop(0))
        for _, outcome in driver.step():
            assert not isinstance(outcome, Exception), outcome
    assert [g.token_ids for g in gens] == [a.token_ids for a in alone]
    assert driver.batched_rows > 0


def test_what_cannot_be_compiled_is_a_clear_error(generators):
    g = generators["greedy"]
    with pytest.raises(GrammarError, match="cannot compile this json_schema"):
        g.grammar(json_schema={"type": "object", "properties": {"a": {"type": "no-such-type"}}})
    with pytest.raises(GrammarError, match="cannot compile this regex"):
        g.grammar(regex="(unclosed")
    with pytest.raises(GrammarError, match="exactly one of json_schema, regex and lark"):
        g.grammar(json_schema=PERSON, regex="a+")
    assert g.grammar(json_schema=PERSON) is g.grammar(json_schema=dict(PERSON)), "compiled once per source"


def test_greedy_rows_under_a_grammar_choose_what_the_masked_rows_choose_masking_only_where_needed(generators):
    """`GrammarState.choose_greedy` (what greedy decoding under a grammar runs) against the argmax of every row
    masked (`GrammarState.constrain`), over the states of a real constrained answer: rows whose own argmax the
    grammar allows, rows whose first maximum is a refused token tied with the draft's (only the mask can pick the
    draft's), rows of noise (the grammar refuses most tokens), the end where only EOS is left, and rows past the
    first disagreement (no mask computed, not chosen). The answer holds a token the matcher accepts and the mask
    refuses (SmolLM2 writes ``":`` then ``"`` where the mask allows only ``":"``), so the mask must decide."""
    plain = generators["greedy"]
    grammar = plain.grammar(json_schema=PERSON)
    answer = plain.generate(PROMPTS["person"], 60, chat=True, grammar=grammar)
    assert answer.stop_reason == "eos"
    eos = plain.tokenizer.eos_token_id
    tokens = [*answer.token_ids, eos] if answer.token_ids[-1] != eos else list(answer.token_ids)
    state, noise = grammar.state(), torch.Generator().manual_seed(0)
    ties = masks = chosen = 0
    for start in range(len(tokens)):
        draft = tokens[start : start + 4]
        allowed = state.row_masks(draft[:-1]).clone()
        assert all(allowed[i, t] for i, t in enumerate(draft[:-1]))  # plain decoding chose under these masks
        scores = torch.randn(len(draft) + 1, grammar.vocab, generator=noise)
        for i, token in enumerate(draft[:-1] if start % 3 else draft):
            scores[i, token] = 10.0
            refused = (~allowed[i, :token]).nonzero()
            if i % 2 and len(refused):  # an earlier refused token ties with the draft's: the first maximum is refused
                scores[i, int(refused[0])] = 10.0
                ties += 1
        before = state.masks
        got = state.choose_greedy(scores, draft)
        computed = state.masks - before
        expected = state.constrain(scores, draft).argmax(dim=-1).tolist()
        agree = next((i for i, (d, e) in enumerate(zip(draft, expected, strict=False)) if d != e), len(draft))
        assert got[: agree + 1] == expected[: agree + 1], (start, draft)
        refused = sum(not allowed[i, int(scores[i].argmax())] for i in range(min(agree + 1, len(draft))))
        assert got[agree + 1 :] == [-1] * (len(draft) - agree) and refused <= computed <= agree + 1
        masks += computed
        chosen += agree + 1
        if start < len(tokens) - 1:
            state.advance(tokens[start : start + 1])
    assert ties > 10
    assert 0 < masks < chosen, "a mask only where the row's argmax is refused"


def test_whether_the_mask_allows_a_token_is_told_without_the_mask_as_the_mask_tells_it(generators, ngram_outputs):
    """`GrammarState._allows` (what greedy decoding under a grammar asks before it computes a mask) against the
    mask's own bit, over every state of real constrained answers (the four schemas and a regex): every token of
    every eighth state; in the others the tokens that share a first byte with the forced bytes (a spelling of
    their beginning, the mask allows it unchecked; or tokens that begin with them), those the mask allows, EOS and
    a random sample. All three kinds of state occur: a forced token (the mask allows it alone), forced bytes that
    no token spells for sure (``":"`` before a string), none forced."""
    fast = generators["ngram"]
    answers = [
        (fast.grammar(json_schema=SCHEMAS[n]), ngram_output(generators, ngram_outputs, n).token_ids) for n in SCHEMAS
    ]
    plain = generators["greedy"]
    sentence = plain.grammar(regex=SENTENCE)
    answers.append((sentence, plain.generate("Where is Maria from?", BUDGET, grammar=sentence).token_ids))
    spelling, vocab = answers[0][0].state().spelling, answers[0][0].vocab
    by_first: dict[bytes, list[int]] = {}
    for t in range(vocab):
        by_first.setdefault(spelling.decode_bytes([t])[:1], []).append(t)
    rng, kinds, checked = random.Random(0), Counter(), 0
    for grammar, tokens in answers:
        state = grammar.state()
        for k, token in enumerate([*tokens, None]):
            matcher = state._matcher
            if matcher.is_stopped():
                assert state._allows(0) is None
                break
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            ahead = matcher.compute_ff_bytes()
            kind = "forced token" if ahead and matcher.compute_ff_tokens() else "forced bytes" if ahead else "free"
            kinds[kind] += 1
            if k % 8 == 0:
                candidates: set[int] = set(range(vocab))
            else:
                allowed = np.flatnonzero(bits[:vocab])[:200].tolist()
                candidates = {*by_first.get(ahead[:1], []), *allowed, *rng.sample(range(vocab), 200), *state._eos}
            for t in candidates:
                assert state._allows(t) == bool(bits[t]), (kind, ahead, spelling.decode_bytes([t]))
                if kind == "forced bytes" and bits[t] and len(spelling.decode_bytes([t])) < len(ahead):
                    kinds["a beginning of the forced bytes allowed"] += 1
            checked += len(candidates)
            if token is None:
                break
            state.advance([token])
    assert min(kinds.values()) > 0 and len(kinds) == 4, kinds
    assert checked > 500_000


def test_the_grammar_spells_the_bytes_it_forces_as_the_model_spelled_them_and_closes_copied_values(generators):
    """Past llguidance's forced tokens the grammar still forces bytes (``":"`` after a key before a string): they
    are drafted as the tokenizer spells them until the model spells the same leading punctuation otherwise
    (SmolLM2: ``":`` then ``"``), then as the model did. A JSON string copied from a document is closed where its
    clause ends (``,`` before a space), never inside a token run like ``.com`` or in a number."""
    grammar = generators["greedy"].grammar(json_schema=PERSON)
    state = grammar.state()
    spell, text = state.spelling.tokenize_bytes, state.spelling.decode_bytes
    state.advance(spell(b'{"name'))
    forced, spelled = state.forced(8)
    assert forced == [] and text(spelled) == b'":"' and spelled == spell(b'":"')
    model = [*spell(b'":'), *spell(b'"')]  # the model's own spelling of the same bytes
    assert len(model) == 2 and spelled != model
    state.advance([model[0]])  # learned at the first token: `":` begins `":"`
    state.advance([model[1], *spell(b"Maria"), *spell(b'",'), *spell(b'"age":23,"city')])
    forced, spelled = state.forced(8)
    assert forced == [] and spelled[0] == model[0] and text(spelled) == b'":"'
    state.advance(spelled[:1] + spell(b'"'))
    copied = spell(b" Madrid, where she lives")
    end = state.clause_end(copied)
    assert text(copied[:end]) == b" Madrid" and end < len(copied)
    forced, spelled = state.forced(8, after=copied[:end], close=True)
    assert forced == [] and text(spelled).startswith(b'","skills":[')
    assert state.clause_end(spell(b"dan.okafor@example.com")) == len(spell(b"dan.okafor@example.com"))
    numbers = grammar.state()
    numbers.advance(spell(b'{"name":"Maria","age":'))
    digits = spell(b"23, 24 and")
    assert numbers.clause_end(digits) == len(digits)  # no string to close in a number


def test_prompt_lookup_under_a_grammar_drafts_from_the_text_where_no_token_ngram_matches(generators):
    """A value copied into JSON begins with other tokens than the prompt's words (``"Mad`` where the prompt spells
    `` Madrid``): no n-gram of tokens matches, the text does, and its continuation is spelled in tokens (the last,
    maybe cut, left out)."""
    from lattice_inference.drafters.ngram import NgramDrafter

    spelling = generators["greedy"].grammar(json_schema=PERSON).state().spelling
    spell, text = spelling.tokenize_bytes, spelling.decode_bytes
    prompt = spell(b"Maria Lopez lives in Madrid, Spain, and works at Acme Robotics.")
    output = spell(b'{"city":"Mad')
    assert output[-1] not in prompt  # no 1-gram of tokens to match
    state = NgramDrafter(max_draft=6).new_state(prompt)
    plain = NgramDrafter(max_draft=6).new_state(prompt)
    plain.under_grammar()
    plain.extend(output)
    assert list(plain.propose(6)) == []
    state.under_grammar(spelling)
    state.extend(output)
    draft = list(state.propose(6))
    assert draft and text(draft).startswith(b"rid, Spain") and len(draft) <= 6
    # a string's first word, nowhere after a quote before: looked for as a word of the text
    state = NgramDrafter(max_draft=6).new_state(spell(b"The owner is Priya Shah, and Tom Berg helps."))
    state.under_grammar(spelling)
    state.extend(spell(b'{"owner":"P'))
    assert text(list(state.propose(6))).startswith(b"riya Shah")


def test_what_the_model_spelled_is_kept_for_the_next_request_of_its_scope(generators):
    """The spellings one constrained generation learned (`GrammarState.spellings`) seed the next generation of the
    same scope (the decoder keeps them with the acceptance statistics), and only of that scope."""
    fast = generators["ngram"]
    decoder, prompt = fast.decoder, fast.encode(PROMPTS["person"], True)
    grammar = fast.grammar(json_schema=PERSON)
    first = decoder.start(prompt, 24, grammar=grammar.state(), scope="spellings-a")
    first.result()
    assert first.grammar is not None and first.grammar.spellings  # SmolLM2 spells '":"' as '":' then '"'
    later = decoder.start(prompt, 4, grammar=grammar.state(), scope="spellings-a")
    other = decoder.start(prompt, 4, grammar=grammar.state(), scope="spellings-b")
    for gen in (later, other):
        next(iter(gen))  # opened: the prefill's tokens emitted, nothing drafted or learned yet
    assert later.grammar is not None and other.grammar is not None
    assert later.grammar.spellings == first.grammar.spellings and other.grammar.spellings == {}
    later.result()
    other.result()
