"""Predicted outputs (OpenAI's ``prediction``): a request's prediction drafted from, the output unchanged.

`PredictionState` follows a prediction (cursor, departure, rejoin after the cursor or anywhere, lost); a decoder
given a prediction emits token for token what it emits without one, greedy and seeded, alone and batched, with no
drafter or ahead of `ngram`, on predictions that are the output itself, an edit of it, or unrelated; its counts
are OpenAI's; a bad prediction is refused naming it, in the API and the server; and the real default model and the
server give the same text with and without one.
"""

from __future__ import annotations

import random

import pytest
import torch

from lattice_inference.batching import Batch
from lattice_inference.decode import SpeculativeDecoder
from lattice_inference.drafters.ngram import NgramDrafter
from lattice_inference.drafters.prediction import PREDICTION_KEY, REJOIN_NGRAM, REJOINED_KEY, PredictionState
from lattice_inference.errors import TokenError
from lattice_inference.sampling import SamplingOptions
from lattice_inference.targets.lean import LeanTarget
from lattice_testing.toy import toy_config, toy_model

from .serve_harness import MODEL_NAME, request, running_server

EOS = 256


def test_the_state_follows_the_prediction_departs_and_rejoins_after_its_cursor():
    prediction = [*range(10, 30), 5, 6, 7, *range(40, 60)]
    state = PredictionState(prediction)
    first = state.propose(4)
    assert list(first) == [10, 11, 12, 13] and first.key == PREDICTION_KEY
    state.extend([10, 11, 12, 13, 14])  # all four accepted, and the target's next token follows the prediction
    assert (state.accepted, state.rejected, state.cursor) == (4, 0, 5)
    assert list(state.propose(3)) == [15, 16, 17]
    state.extend([15, 99])  # one accepted, then the output departs (an edit)
    assert (state.accepted, state.rejected, state.cursor) == (5, 2, None)
    assert list(state.propose(3)) == []  # lost, and no method behind it
    state.extend([98])
    state.extend([19])  # the output's last tokens [99, 98, 19] are nowhere in the prediction: still lost
    assert state.cursor is None
    state.extend([20, 21])  # [19, 20, 21] ends at index 12 of the prediction: past where it left (6), rejoined
    assert state.cursor == 12
    rejoined = state.propose(2)
    assert list(rejoined) == [22, 23] and rejoined.key == REJOINED_KEY
    assert state.accepted == 5  # tokens the target produced itself are not the prediction's


def test_a_rejoin_prefers_the_place_after_the_cursor_then_anywhere():
    block = [1, 2, 3]
    prediction = [*block, 70, 71, *block, 80, 81]
    state = PredictionState(prediction)
    state.extend([*block, 70, 71])
    state.extend([*block, 90])  # departs at 90 (expected 80); the output's [2, 3, 90] is not in the prediction
    state.extend(block)  # [1, 2, 3] again: after where the output left (index 8) there is none: the first anywhere
    assert state.cursor == REJOIN_NGRAM
    state2 = PredictionState(prediction)
    state2.extend([50, *block])  # departs at once; [1, 2, 3] ends at 3 and at 8: the first past index 0
    assert state2.cursor == 3


def test_while_the_prediction_has_nothing_the_method_drafts_and_sees_every_token():
    prompt = [7, 8, 9, 1, 2, 3, 4]
    then = NgramDrafter(max_ngram=2, min_ngram=1, max_draft=4).start(prompt)
    state = PredictionState([1, 2], then)
    assert list(state.propose(4)) == [1, 2]
    state.extend([1, 2])
    proposal = state.propose(4)  # past the prediction's end: the n-gram lookup of the history [.., 1, 2]
    assert proposal[:2] == [3, 4] and proposal.key != PREDICTION_KEY


def _model(arch: str, dtype: torch.dtype = torch.float32):
    return toy_model(toy_config(arch), init_std=0.4, seed=3).to(dtype)


def _edited(tokens: list[int], rng: random.Random) -> list[int]:
    """``tokens`` with a few substitutions, an insertion and a deletion: an edit's prediction."""
    out = list(tokens)
    for _ in range(3):
        if len(out) > 4:
            out[rng.randrange(len(out))] = rng.randrange(256)
    at = rng.randrange(len(out) + 1)
    out[at:at] = [rng.randrange(256) for _ in range(3)]
    if len(out) > 6:
        del out[rng.randrange(len(out) - 2) : rng.randrange(len(out) - 2) + 2]
    return out


SAMPLINGS = [SamplingOptions(), SamplingOptions(temperature=0.8, seed=7)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_prediction_never_changes_the_output_alone_or_batched(arch, sampling):
    """Predictions that are the output (through its EOS), an edit of it, and unrelated tokens; no drafter and
    `ngram` behind them; each generation alone and all in one batch: every output is plain decoding's."""
    target = LeanTarget(_model(arch))
    plain = SpeculativeDecoder(target, None, eos_token_ids=[EOS])
    ngram = SpeculativeDecoder(target, NgramDrafter(max_draft=6), max_draft=6, eos_token_ids=[EOS])
    rng = random.Random(arch)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 30))] for _ in range(4)]
    budget = 28
    wants = [plain.generate(p, budget, sampling).token_ids for p in prompts]
    free = [plain.generate(p, budget + 6, sampling).token_ids for p in prompts]
    cases = []
    for prompt, want, longer in zip(prompts, wants, free, strict=True):
        whole = longer + ([EOS] if len(longer) < budget + 6 else [])
        for prediction in (whole, _edited(want, rng), [rng.randrange(256) for _ in range(40)]):
            cases.append((prompt, want, prediction))
    for decoder in (plain, ngram):
        counted = {"accepted": 0, "rejected": 0}
        for prompt, want, prediction in cases:
            gen = decoder.start(prompt, budget, sampling, prediction=prediction)
            assert gen.result().token_ids == want
            counted["accepted"] += gen.metrics.accepted_prediction_tokens
            counted["rejected"] += gen.metrics.rejected_prediction_tokens
        assert counted["accepted"] > 0 and counted["rejected"] > 0  # drafts fully accepted, and refused
        batch = Batch(target)
        gens = [decoder.new_generation(p, budget, sampling, prediction=pred) for p, _, pred in cases]
        waiting = list(gens)
        while waiting or len(batch):
            while waiting and len(batch) < 4:
                batch.add(decoder, waiting.pop(0))
            batch.step()
        for gen, (_, want, _) in zip(gens, cases, strict=True):
            assert gen.token_ids == want
        assert batch.batched_rows > 0


def test_the_whole_output_as_prediction_is_accepted_and_counted():
    target = LeanTarget(_model("llama"))
    plain = SpeculativeDecoder(target, None, eos_token_ids=[EOS], max_draft=8)
    prompt = [5, 17, 99, 3, 42]
    want = plain.generate(prompt, 40).token_ids
    gen = plain.start(prompt, 40, prediction=want)
    result = gen.result()
    assert result.token_ids == want
    m = result.metrics
    assert m.accepted_prediction_tokens >= len(want) // 2 and m.rejected_prediction_tokens == 0
    assert m.target_forwards < len(want) // 2  # several tokens a forward
    departing = plain.start(prompt, 40, prediction=want[:12] + [(t + 1) % 256 for t in want[12:]])
    assert departing.result().token_ids == want
    assert departing.metrics.accepted_prediction_tokens <= 12 < 12 + departing.metrics.rejected_prediction_tokens
    unrelated = plain.start(prompt, 40, prediction=[(t + 1) % 256 for t in want])
    assert unrelated.result().token_ids == want  # it departs at the first token: nothing drafted, nothing counted
    assert unrelated.metrics.accepted_prediction_tokens == unrelated.metrics.rejected_prediction_tokens == 0


def test_a_bad_prediction_is_refused_naming_it():
    target = LeanTarget(_model("llama"))
    plain = SpeculativeDecoder(target, None, eos_token_ids=[EOS])
    with pytest.raises(TokenError, match="prediction token 1 has id 9999, outside the vocabulary"):
        plain.start([1, 2, 3], 4, prediction=[1, 9999])
    limit = target.max_positions
    assert limit is not None
    with pytest.raises(TokenError, match=r"prediction of \d+ tokens plus the prompt's 3 exceeds"):
        plain.start([1, 2, 3], 4, prediction=[1] * limit)


def test_the_default_model_gives_the_same_answer_with_its_edit_predicted(smollm2_generators):
    """The real SmolLM2: an edit of a text with the text as the prediction, greedy and `ngram`: the same tokens as
    without, and most of the prediction accepted."""
    source = "\n".join(f"def step_{i}(state):\n    return state + {i}\n" for i in range(8))
    prompt = "Rename every function step_N to advance_N in this code and output the whole code:\n\n" + source
    for name in ("greedy", "ngram"):
        gen = smollm2_generators[name]
        want = gen.generate(prompt, 120, chat=True)
        got = gen.generate(prompt, 120, chat=True, prediction=source)
        assert got.token_ids == want.token_ids, name
        assert got.metrics.accepted_prediction_tokens > 0
        if name == "greedy":  # `ngram` finds the file in the prompt too: the prediction saves it nothing more
            assert got.metrics.target_forwards < want.metrics.target_forwards
        else:
            assert got.metrics.target_forwards <= want.metrics.target_forwards


def test_the_server_drafts_from_a_prediction_and_reports_its_counts(loaded):
    with running_server(loaded, method="ngram") as (base, _):
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say the numbers"}], "max_tokens": 24}
        plain = request(base, "POST", "/v1/chat/completions", body).json()
        text = plain["choices"][0]["message"]["content"]
        usage = plain["usage"]["completion_tokens_details"]
        assert usage == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
        for prediction in (text, [{"type": "text", "text": text[:10]}, {"type": "text", "text": text[10:]}]):
            predicted = {**body, "prediction": {"type": "content", "content": prediction}}
            answer = request(base, "POST", "/v1/chat/completions", predicted).json()
            assert answer["choices"][0]["message"]["content"] == text
            details = answer["usage"]["completion_tokens_details"]
            assert details["accepted_prediction_tokens"] > 0
            assert answer["speculative_metrics"]["accepted_prediction_tokens"] == details["accepted_prediction_tokens"]
        bad = request(base, "POST", "/v1/chat/completions", {**body, "prediction": "text"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prediction"
        too_long = {**body, "prediction": {"type": "content", "content": "word " * 100_000}}
        refused = request(base, "POST", "/v1/chat/completions", too_long)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prediction"
        assert "prediction" in refused.json()["error"]["message"]
        completion = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 16}
        want = request(base, "POST", "/v1/completions", completion).json()["choices"][0]["text"]
        got = request(
            base, "POST", "/v1/completions", {**completion, "prediction": {"type": "content", "content": want}}
        ).json()
        assert got["choices"][0]["text"] == want
        assert got["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
