"""The real default model in bfloat16: decode-matched verification makes every method emit plain decoding's tokens.

SmolLM2-135M-Instruct (GGUF dequantized to bfloat16): the target's self-check finds every verification width
exact, and prompt lookup (planned and fixed drafts), the shipped MTP head, ngram+mtp and seeded sampling emit
exactly what plain decoding through the same model emits, on grounded prompts. Before decode matching, rows of a
k-token forward differed from the 1-token step by up to 0.6 in a logit here, and outputs drifted on near-ties.
Skipped, saying why, where the package is absent.

Drafts are forced where a test is about them (fixed drafts, or flat forward costs given to the planner): on a CPU
that emulates bfloat16 verification is dear and the planner rightly drafts little, which must not decide what is
tested. There (no AVX512_BF16 or AMX, or torch held to AVX2) every forward costs several times more, so the
checks run on fewer prompts and shorter generations; where bfloat16 is native, the full set.
"""

from __future__ import annotations

import inspect
import string

import pytest

from lattice_inference import Generator
from lattice_inference.api import mtp_head_for
from lattice_inference.benchmark import GROUNDED_TASKS, encode_prompt, load_prompts
from lattice_inference.cpu_features import has_native_bf16
from lattice_inference.models.load import load_model
from lattice_inference.targets import make_target
from lattice_inference.targets.exactness import check_exactness

from .helpers import FLAT_COSTS, skip_without_real_model

skip_without_real_model()

NATIVE_BF16 = has_native_bf16()
BUDGET = 48 if NATIVE_BF16 else 32
PROMPTS = 5 if NATIVE_BF16 else 3


@pytest.fixture(scope="module")
def loaded():
    return load_model("smollm2", dtype="bfloat16")


def test_self_check_finds_every_width_exact(loaded) -> None:
    report = check_exactness(make_target(loaded.model), 11)
    assert report.exact, report.failures
    assert report.widths == tuple(range(2, 12)) and report.trees


def test_self_check_finds_every_width_exact_on_onednn(monkeypatch) -> None:
    """The products on oneDNN (``LATTICE_TILES=0 LATTICE_ROWS=0``; what runs where our kernels cannot), whose
    bfloat16 product over 1536 inputs splits its reduction by row count on AVX512-BF16 CPUs without AMX: the row
    plans must find that on the model's own activations (before spread-magnitude calibration inputs, widths 4+
    differed here)."""
    monkeypatch.setenv("LATTICE_TILES", "0")
    monkeypatch.setenv("LATTICE_ROWS", "0")
    model = load_model("smollm2", dtype="bfloat16").model
    report = check_exactness(make_target(model), 11)
    assert report.exact, report.failures


def test_every_method_equals_plain_decoding_in_bfloat16(loaded) -> None:
    common = dict(eos_token_ids=loaded.eos_token_ids)
    plain = Generator(loaded.model, loaded.tokenizer, method="greedy", **common)
    head = mtp_head_for(loaded, 3)
    planned = dict(costs=FLAT_COSTS, **common)  # the planner runs, and drafting pays wherever drafts are accepted
    methods = {
        "ngram": Generator(loaded.model, loaded.tokenizer, method="ngram", **planned),
        "ngram-fixed": Generator(loaded.model, loaded.tokenizer, method="ngram", adaptive=False, **common),
        "mtp": Generator(loaded.model, loaded.tokenizer, method="mtp", draft_length=3, mtp_head=head, **planned),
        "ngram+mtp": Generator(
            loaded.model, loaded.tokenizer, method="ngram+mtp", draft_length=3, mtp_head=head, **planned
        ),
    }
    prompts = [p for p in load_prompts(GROUNDED_TASKS) if p.set == "grounded"][1::7][:PROMPTS]
    accepted = dict.fromkeys(methods, 0)
    for i, p in enumerate(prompts):
        ids = encode_prompt(plain, p)
        want = plain.generate(ids, BUDGET).token_ids
        for name, gen in methods.items():
            got = gen.generate(ids, BUDGET)
            assert got.token_ids == want, (p.id, name)
            assert got.metrics.exact is True
            accepted[name] += got.metrics.accepted_tokens
        sampled = plain.generate(ids, BUDGET, temperature=0.8, top_p=0.95, seed=i).token_ids
        got = methods["ngram"].generate(ids, BUDGET, temperature=0.8, top_p=0.95, seed=i)
        assert got.token_ids == sampled, (p.id, "sampled")
    assert all(accepted.values()), accepted


@pytest.fixture(scope="module")
def reusable(loaded):
    """The model in bfloat16 where bfloat16 is native; elsewhere in float32 (what ``--dtype auto`` picks there),
    whose rows our float32 products make reusable, where emulated bfloat16 rows, on oneDNN, are not."""
    return loaded if NATIVE_BF16 else load_model("smollm2", dtype="float32")


def test_a_long_document_conversation_reuses_rows_past_1024_tokens(reusable) -> None:
    """Two turns over a 1300-token document (``string.py``'s source; past the 1024 tokens the native prefill
    was once limited to): the second turn's prefill keeps the first turn's rows and emits what a generator
    computing every prompt row emits, with ngram drafting."""
    loaded = reusable
    document = inspect.getsource(string)[:5200]
    common = dict(eos_token_ids=loaded.eos_token_ids, method="ngram")
    reusing = Generator(loaded.model, loaded.tokenizer, **common)
    fresh = Generator(loaded.model, loaded.tokenizer, prefix_cache=False, **common)
    turns = [{"role": "user", "content": f"File string.py:\n\n{document}\n\nWhat does `capwords` do?"}]
    first = reusing.generate(reusing.encode_messages(turns), 16)
    turns += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Quote its first line."}]
    ids = reusing.encode_messages(turns)
    assert len(ids) > 1024
    got = reusing.generate(ids, 16)
    assert got.token_ids == fresh.generate(ids, 16).token_ids
    if reusing.decoder.target._row_key("") is not None:  # type: ignore[attr-defined]  # rows reusable here at all
        assert got.metrics.cached_prompt_tokens > 1024


def test_a_conversation_reusing_its_cache_equals_fresh_prefills(loaded) -> None:
    """Three chat turns, each prompt holding the earlier turns and answers: generators that keep the cached rows
    of the shared prefix (``prefix_cache``, the default) emit what generators computing every prompt row emit."""
    common = dict(eos_token_ids=loaded.eos_token_ids)
    first = load_prompts(GROUNDED_TASKS)[0]
    document = first.prompt or (first.messages or [{}])[-1]["content"]
    questions = ["Summarise the text in one sentence.", "Quote its first sentence.", "Name one thing it mentions."]
    questions = questions if NATIVE_BF16 else questions[:2]
    for method in ("greedy", "ngram"):
        reusing = Generator(loaded.model, loaded.tokenizer, method=method, **common)
        fresh = Generator(loaded.model, loaded.tokenizer, method=method, prefix_cache=False, **common)
        turns: list[dict[str, str]] = []
        cached = 0
        for i, question in enumerate(questions):
            turns.append({"role": "user", "content": f"{document}\n\n{question}" if i == 0 else question})
            ids = reusing.encode_messages(turns)
            got = reusing.generate(ids, BUDGET)
            assert got.token_ids == fresh.generate(ids, BUDGET).token_ids, (method, i)
            cached += got.metrics.cached_prompt_tokens
            turns.append({"role": "assistant", "content": got.text})
        if reusing.decoder.target._row_key("") is not None:  # type: ignore[attr-defined]
            assert cached > len(ids) // 2, method
