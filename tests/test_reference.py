"""Tests of the seed-compatible API: the seed's tests ported (adjusted where they encoded bugs) plus
losslessness and bookkeeping properties of the corrected ``generate_with_speculation``."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lattice_reference as reference
from lattice_inference.drafters.base import Proposal
from lattice_inference.drafters.ngram import NgramDrafter, NgramState
from lattice_inference.errors import ConfigError, TokenError
from lattice_reference import NgramSpeculator, argmax, generate_with_speculation, verify_draft

# ---------------------------------------------------------------------------------------------------------
# Mock models
# ---------------------------------------------------------------------------------------------------------


def one_hot(vocab: int, token: int) -> list[float]:
    logits = [0.0] * vocab
    if token < vocab:
        logits[token] = 1.0
    return logits


class ContextModel:
    """A deterministic "model" whose logits are a function of the whole context it has been fed.

    It starts having processed ``prompt[:-1]`` (the precondition of generate_with_speculation). A call
    ``(token, position)`` writes ``token`` at ``position`` of its cache (dropping anything after it, like a
    cache indexed by position) and returns ``logits_fn(tuple(cache))``. Every call is recorded.
    """

    def __init__(self, prompt: Sequence[int], logits_fn: Callable[[tuple[int, ...]], list[float]]) -> None:
        self.cache = list(prompt[:-1])
        self.logits_fn = logits_fn
        self.calls: list[tuple[int, int]] = []

    def __call__(self, token: int, position: int) -> list[float]:
        self.calls.append((token, position))
        self.cache = [*self.cache[:position], token]
        return self.logits_fn(tuple(self.cache))


def plain_greedy(prompt: Sequence[int], max_new_tokens: int, eos: int | None, model: ContextModel) -> list[int]:
    """Plain greedy decoding: feed one token, take the argmax, repeat."""
    tokens = list(prompt)
    out: list[int] = []
    while len(out) < max_new_tokens:
        nxt = argmax(model(tokens[-1], len(tokens) - 1))
        if nxt == eos:
            break
        out.append(nxt)
        tokens.append(nxt)
    return out


def assert_fed_once_in_order(calls: list[tuple[int, int]], prompt: Sequence[int], out: Sequence[int]) -> None:
    """Each fed token sits at position == its index, positions contiguous from P-1, none fed twice."""
    full = [*prompt, *out]
    positions = [pos for _, pos in calls]
    assert positions == list(range(len(prompt) - 1, len(prompt) - 1 + len(calls)))
    assert all(full[pos] == tok for tok, pos in calls if pos < len(full))


def copy_prompt_model(prompt: Sequence[int], vocab: int = 100) -> Callable[[tuple[int, ...]], list[float]]:
    """Predicts the token after the first occurrence of the context's last token in the prompt (cyclic)."""

    def logits(context: tuple[int, ...]) -> list[float]:
        i = prompt.index(context[-1]) if context[-1] in prompt else -1
        return one_hot(vocab, prompt[(i + 1) % len(prompt)])

    return logits


class RecordingState(NgramState):
    """An `NgramState` that records each proposal and whether EOS truncated it (in `RecordingDrafter.log`)."""

    drafter: NgramDrafter

    def propose(self, max_tokens: int) -> Proposal:
        draft = super().propose(max_tokens)
        drafter = self.drafter
        eos, drafter.eos_token_ids = drafter.eos_token_ids, frozenset()
        untruncated = super().propose(max_tokens)
        drafter.eos_token_ids = eos
        RecordingDrafter.log.append((draft, len(untruncated) > len(draft)))
        return draft


class RecordingDrafter(NgramDrafter):
    """NgramDrafter whose generations record each proposal and whether EOS truncated it."""

    log: ClassVar[list[tuple[list[int], bool]]] = []

    def new_state(self, prompt_ids, sampler=None, suffix_index=None) -> RecordingState:
        return RecordingState(self, list(super().new_state(prompt_ids, sampler, suffix_index).history))


@pytest.fixture
def spy(monkeypatch):
    """Records proposals and verify_draft results of generate_with_speculation."""
    verify_log: list[tuple[int, int]] = []  # (accepted, draft length)
    real_verify = reference.verify_draft

    def recording_verify(draft, position_start, forward_fn):
        accepted, logits = real_verify(draft, position_start, forward_fn)
        verify_log.append((accepted, len(draft)))
        return accepted, logits

    RecordingDrafter.log = []
    monkeypatch.setattr(reference, "verify_draft", recording_verify)
    monkeypatch.setattr(reference, "NgramDrafter", RecordingDrafter)
    return RecordingDrafter.log, verify_log


# ---------------------------------------------------------------------------------------------------------
# NgramSpeculator (seed tests, unchanged semantics)
# ---------------------------------------------------------------------------------------------------------


def test_speculate_basic_ngram_match():
    spec = NgramSpeculator([1, 2, 3, 4, 5, 6, 7], 5, 3)
    # Recent [2, 3, 4] matches prompt[1..4], should draft [5, 6, 7]
    assert spec.speculate([2, 3, 4]) == [5, 6, 7]


def test_speculate_no_match_returns_empty():
    spec = NgramSpeculator([1, 2, 3], 5, 3)
    assert spec.speculate([10, 11, 12]) == []


def test_speculate_empty_recent_returns_empty():
    spec = NgramSpeculator([1, 2, 3, 4], 5, 3)
    assert spec.speculate([]) == []


def test_speculate_single_recent_token_skipped():
    # Minimum n-gram is 2, so a single recent token cannot match.
    spec = NgramSpeculator([1, 2, 3, 4], 5, 3)
    assert spec.speculate([2]) == []


def test_speculate_prefers_longest_match():
    # The 4-gram [2, 3, 4, 5] occurs at prompt[1..5], so the draft is prompt[5..8] = [3, 4, 5]; the trigram
    # [3, 4, 5] alone would have drafted from its first occurrence at prompt[2..5] as well, but the 4-gram wins.
    spec = NgramSpeculator([1, 2, 3, 4, 5, 3, 4, 5, 6, 7], 5, 3)
    assert spec.speculate([2, 3, 4, 5]) == [3, 4, 5]
    # With max_ngram 3 the trigram's first occurrence (prompt[2..5]) drafts the same tokens.
    assert NgramSpeculator([1, 2, 3, 4, 5, 3, 4, 5, 6, 7], 3, 3).speculate([9, 3, 4, 5]) == [3, 4, 5]


def test_speculate_max_draft_limits_output():
    spec = NgramSpeculator([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 5, 2)
    # Match [1, 2] at pos 0, max_draft=2 so drafts [3, 4] only
    assert spec.speculate([1, 2]) == [3, 4]


def test_speculate_match_at_end_of_prompt_returns_empty():
    # Match is at the very end of prompt -- nothing left to draft
    spec = NgramSpeculator([1, 2, 3], 5, 3)
    assert spec.speculate([2, 3]) == []


def test_speculate_match_near_end_returns_partial():
    # Match [2, 3] at pos 1, only token 4 left to draft
    spec = NgramSpeculator([1, 2, 3, 4], 5, 3)
    assert spec.speculate([2, 3]) == [4]


def test_speculate_max_ngram_clamped_to_recent_len():
    # max_ngram=10 but only 3 recent tokens -- should still work
    spec = NgramSpeculator([5, 6, 7, 8, 9], 10, 3)
    assert spec.speculate([5, 6, 7]) == [8, 9]


def test_speculate_empty_continuation_falls_back_to_shorter_ngram():
    # [7, 8, 9] only occurs at the end of the prompt (no continuation); [8, 9] fails the same way, so
    # nothing is drafted even though [9] alone would be (n >= 2).
    assert NgramSpeculator([9, 1, 7, 8, 9], 5, 3).speculate([7, 8, 9]) == []
    # [4, 5, 6] ends the prompt, but [5, 6] also occurs earlier with a continuation.
    assert NgramSpeculator([5, 6, 1, 4, 5, 6], 5, 3).speculate([4, 5, 6]) == [1, 4, 5]


# ---------------------------------------------------------------------------------------------------------
# find_ngram (seed tests)
# ---------------------------------------------------------------------------------------------------------


def test_find_ngram_empty_pattern():
    assert NgramSpeculator([1, 2, 3], 5, 3).find_ngram([]) is None


def test_find_ngram_pattern_longer_than_prompt():
    assert NgramSpeculator([1, 2], 5, 3).find_ngram([1, 2, 3]) is None


def test_find_ngram_exact_match():
    assert NgramSpeculator([1, 2, 3], 5, 3).find_ngram([1, 2, 3]) == 0


def test_find_ngram_returns_first_occurrence():
    assert NgramSpeculator([1, 2, 1, 2, 5], 5, 3).find_ngram([1, 2]) == 0


def test_find_ngram_any_pattern_length():
    spec = NgramSpeculator([4, 1, 2, 3, 4, 1, 2, 3, 4], 2, 3)
    assert spec.find_ngram([4]) == 0
    assert spec.find_ngram([3, 4]) == 3
    assert spec.find_ngram([2, 3, 4, 1, 2]) == 2  # longer than max_ngram
    assert spec.find_ngram([1, 2, 3, 4, 1, 2, 3, 4]) == 1
    assert spec.find_ngram([1, 2, 3, 4, 4]) is None


# ---------------------------------------------------------------------------------------------------------
# argmax
# ---------------------------------------------------------------------------------------------------------


def test_argmax_basic():
    assert argmax([0.1, 0.9, 0.5]) == 1


def test_argmax_empty():
    assert argmax([]) == 0
    assert argmax(np.array([], dtype=np.float32)) == 0
    assert argmax(torch.tensor([])) == 0


def test_argmax_tie_first_wins():
    # torch.argmax / numpy parity: the first maximal index wins (the seed's Rust max_by returned the last).
    assert argmax([1.0, 1.0, 0.5]) == 0
    assert argmax(torch.tensor([1.0, 1.0, 0.5], dtype=torch.bfloat16)) == 0
    assert argmax(np.array([0.5, 2.0, 2.0], dtype=np.float32)) == 1


def test_argmax_negative_values():
    assert argmax([-3.0, -1.0, -2.0]) == 1


@pytest.mark.parametrize("kind", ["list", "numpy", "torch"])
def test_argmax_nan_never_wins(kind):
    nan = float("nan")
    convert = {
        "list": list,
        "numpy": lambda v: np.array(v, dtype=np.float32),
        "torch": lambda v: torch.tensor(v, dtype=torch.float32),
    }[kind]
    assert argmax(convert([10.0, nan, 1.0])) == 0  # the seed returned 2
    assert argmax(convert([nan, 1.0, 3.0])) == 2
    assert argmax(convert([nan, -float("inf"), 2.0, nan])) == 2
    assert argmax(convert([nan, -float("inf")])) == 1  # NaN loses even to -inf
    assert argmax(convert([nan, nan])) == 0  # all NaN: 0, like an empty input


def test_argmax_matches_torch_on_random_logits():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = torch.randint(0, 4, (64,), generator=gen).to(dtype)  # many ties
        assert argmax(logits) == int(torch.argmax(logits))
        assert argmax(logits.float().numpy()) == int(torch.argmax(logits))
        assert argmax(logits.tolist()) == int(torch.argmax(logits))


def test_argmax_rejects_2d():
    with pytest.raises(TokenError, match="1-D"):
        argmax(torch.zeros(2, 3))
    with pytest.raises(TokenError, match="1-D"):
        argmax([[1.0, 2.0]])


# ---------------------------------------------------------------------------------------------------------
# verify_draft (seed tests; precondition: draft[0] was already verified by the caller)
# ---------------------------------------------------------------------------------------------------------


def test_verify_draft_all_accepted():
    draft = [1, 2, 3]
    call = 0

    def forward(_tok, _pos):
        nonlocal call
        call += 1
        # After processing draft[i], model predicts draft[i+1]; the last prediction does not matter.
        return one_hot(10, draft[call] if call < len(draft) else 0)

    accepted, logits = verify_draft(draft, 10, forward)
    assert accepted == 3
    assert len(logits) == 3


def test_verify_draft_second_token_rejected():
    # Model always predicts 99, which disagrees with draft[1] = 2. draft[0] is not checked (precondition).
    accepted, logits = verify_draft([1, 2, 3], 0, lambda _tok, _pos: one_hot(100, 99))
    assert accepted == 1
    assert len(logits) == 1
    assert argmax(logits[accepted - 1]) == 99  # the model's correction


def test_verify_draft_partial_acceptance():
    draft = [10, 20, 30, 40]
    predictions = iter([20, 30, 0, 0])  # agrees with draft[1], draft[2], disagrees with draft[3] = 40
    accepted, logits = verify_draft(draft, 0, lambda _tok, _pos: one_hot(50, next(predictions)))
    assert accepted == 3
    assert len(logits) == 3


def test_verify_draft_single_token():
    accepted, logits = verify_draft([42], 5, lambda _tok, _pos: [0.0] * 10)
    assert accepted == 1
    assert len(logits) == 1


def test_verify_draft_empty():
    accepted, logits = verify_draft([], 0, lambda _tok, _pos: [0.0] * 10)
    assert accepted == 0
    assert logits == []


def test_verify_draft_positions_are_correct():
    positions = []
    predictions = iter([2, 3, 0])

    def forward(_tok, pos):
        positions.append(pos)
        return one_hot(10, next(predictions))

    verify_draft([1, 2, 3], 100, forward)
    assert positions == [100, 101, 102]


def test_verify_draft_validates_inputs():
    with pytest.raises(TokenError, match="draft_tokens"):
        verify_draft([1, -1], 0, lambda _tok, _pos: [0.0])
    with pytest.raises(ConfigError, match="position_start must be >= 0, got -1"):
        verify_draft([1], -1, lambda _tok, _pos: [0.0])


# ---------------------------------------------------------------------------------------------------------
# generate_with_speculation
# ---------------------------------------------------------------------------------------------------------


def test_generate_no_speculation_possible():
    # Prompt has no overlap with generated tokens -- falls back to normal decode.
    step = 0

    def forward(_tok, _pos):
        nonlocal step
        step += 1
        return one_hot(200, min(50 + step, 199))

    assert generate_with_speculation([100, 101, 102], 3, 999, forward, 5, 4) == [51, 52, 53]


def test_generate_stops_on_eos():
    calls = []

    def forward(tok, pos):
        calls.append((tok, pos))
        return one_hot(100, 99)  # always predict EOS

    assert generate_with_speculation([1, 2, 3], 100, 99, forward, 5, 4) == []
    assert calls == [(3, 2)]  # the pending last prompt token, at its own position


def test_generate_with_perfect_speculation(spy):
    # The model copies the prompt cyclically: after 6 it predicts 7, ..., after 12 it predicts 5, after 5
    # predicts 6. The prompt ends with [5, 6], whose first occurrence is followed by [7, 8, 9, 10], so drafts
    # fire from the first step and the model accepts them.
    proposals, verify_log = spy
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6]
    model = ContextModel(prompt, copy_prompt_model(prompt))
    out = generate_with_speculation(prompt, 20, 999, model, 5, 4)

    greedy_model = ContextModel(prompt, copy_prompt_model(prompt))
    expected = plain_greedy(prompt, 20, 999, greedy_model)
    assert out == expected == [7, 8, 9, 10, 11, 12, 5, 6] * 2 + [7, 8, 9, 10]
    # Drafts fired and were fully accepted (bonus token emitted each time).
    assert proposals[0][0] == [7, 8, 9, 10]
    assert verify_log and all(accepted == size for accepted, size in verify_log)
    assert sum(accepted + 1 for accepted, _ in verify_log) >= 15
    # One forward per token, exactly the calls of plain greedy decoding: no speed-up on this path.
    assert model.calls == greedy_model.calls
    assert len(model.calls) == 20
    assert_fed_once_in_order(model.calls, prompt, out)


def test_generate_respects_max_new_tokens():
    out = generate_with_speculation([1, 2, 3], 10, 999, lambda _tok, _pos: one_hot(100, 42), 5, 4)
    assert out == [42] * 10


def test_generate_never_exceeds_budget_with_long_drafts(spy):
    _, verify_log = spy
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6]
    for budget in range(7):
        verify_log.clear()
        model = ContextModel(prompt, copy_prompt_model(prompt))
        out = generate_with_speculation(prompt, budget, None, model, 5, 4)
        assert out == [7, 8, 9, 10, 11, 12][:budget]
        assert len(model.calls) == budget
        # A step emits its accepted draft plus one model token: drafts are capped at (budget left - 1).
        assert all(size <= budget - 1 for _, size in verify_log)
        assert bool(verify_log) == (budget >= 2)


def test_generate_eos_in_draft_stops_early():
    # The seed's call-count mock. Prompt [1, 2, 3, EOS, 5]. The seed fed the draft's EOS unverified and
    # returned [2, 3]. Corrected loop: the draft after [2, 3] is [99, 5] cut before EOS, i.e. empty; feeding
    # the pending 3 (call 3) predicts 5, and the output continues to the budget of 20.
    call = 0
    calls = []

    def forward(tok, pos):
        nonlocal call
        call += 1
        calls.append((tok, pos))
        return one_hot(100, {1: 2, 2: 3, 3: 5, 4: 0}.get(call, 42))

    out = generate_with_speculation([1, 2, 3, 99, 5], 20, 99, forward, 5, 4)
    assert out == [2, 3, 5, 0] + [42] * 16
    assert len(out) == 20
    assert calls[:6] == [(5, 4), (2, 5), (3, 6), (5, 7), (0, 8), (42, 9)]
    assert_fed_once_in_order(calls, [1, 2, 3, 99, 5], out)


def test_generate_eos_predicted_by_model_after_2_3(spy):
    # A context-keyed model that really predicts EOS after ..., 2, 3: the output stops there.
    proposals, verify_log = spy
    prompt = [1, 2, 3, 99, 5]

    def logits(context: tuple[int, ...]) -> list[float]:
        following = {5: 2, 2: 3, 3: 99}
        return one_hot(100, following.get(context[-1], 0))

    model = ContextModel(prompt, logits)
    assert generate_with_speculation(prompt, 20, 99, model, 5, 4) == [2, 3]
    assert model.calls == [(5, 4), (2, 5), (3, 6)]
    # The only match ([2, 3] -> [99, 5]) was cut before EOS: nothing was drafted, EOS came from the model.
    assert ([], True) in proposals
    assert verify_log == []


def test_generate_rejects_draft_whose_first_token_disagrees(spy):
    # After [..., 1, 2] the prompt suggests [3, 4, 5, 6], but the model predicts 9: the draft is rejected
    # without feeding any of it, and the model's token is emitted.
    proposals, verify_log = spy
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]

    def logits(context: tuple[int, ...]) -> list[float]:
        return one_hot(20, 9 if context[-1] == 2 else 10 + len(context) % 10)

    model = ContextModel(prompt, logits)
    out = generate_with_speculation(prompt, 5, None, model, 5, 4)
    assert proposals[0][0] == [3, 4, 5, 6]
    assert verify_log == []
    assert out == plain_greedy(prompt, 5, None, ContextModel(prompt, logits)) == [9, 19, 10, 11, 12]
    assert model.calls == [(2, 7), (9, 8), (19, 9), (10, 10), (11, 11)]


def test_generate_zero_budget_makes_no_calls():
    calls = []
    assert generate_with_speculation([1, 2], 0, 0, lambda t, p: calls.append((t, p)) or [1.0], 5, 4) == []
    assert calls == []


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"prompt_tokens": []}, TokenError, "prompt_tokens is empty"),
        ({"prompt_tokens": [1, -5]}, TokenError, "element 1 is -5"),
        ({"eos_token": -1}, TokenError, "eos_token"),
        ({"max_new_tokens": -1}, ConfigError, "max_new_tokens must be >= 0, got -1"),
        ({"max_ngram": 1}, ConfigError, "max_ngram must be >= 2, got 1"),
        ({"max_draft": 0}, ConfigError, "max_draft must be >= 1, got 0"),
    ],
)
def test_generate_validates_inputs(kwargs, error, message):
    args = {"prompt_tokens": [1, 2], "max_new_tokens": 4, "eos_token": 0, "max_ngram": 5, "max_draft": 4}
    args.update(kwargs)
    with pytest.raises(error, match=message):
        generate_with_speculation(forward_fn=lambda _tok, _pos: [1.0], **args)


def test_speculator_validates_inputs():
    with pytest.raises(ConfigError, match="max_ngram must be >= 2, got 1"):
        NgramSpeculator([1, 2], 1, 4)
    with pytest.raises(ConfigError, match="max_draft must be >= 1, got 0"):
        NgramSpeculator([1, 2], 5, 0)
    with pytest.raises(TokenError, match="prompt_tokens"):
        NgramSpeculator([1, -2], 5, 4)


# ---------------------------------------------------------------------------------------------------------
# Losslessness: random context-keyed models, speculative == plain greedy, each token fed once
# ---------------------------------------------------------------------------------------------------------


def hash_model(seed: int, vocab: int, window: int, period: int, eos: int | None, eos_penalty: float):
    """Logits = a deterministic hash of (the last ``window`` tokens, context length mod ``period``).

    Small integer logits make ties common; a small vocab makes contexts repeat, so drafts fire and are
    accepted, partly accepted or rejected. ``eos_penalty`` makes EOS rarer.
    """

    def logits(context: tuple[int, ...]) -> list[float]:
        rng = random.Random(hash((seed, context[-window:], len(context) % period)))
        values = [float(rng.randrange(4)) for _ in range(vocab)]
        if eos is not None and eos < vocab:
            values[eos] -= eos_penalty
        return values

    return logits


def run_case(seed, vocab, window, period, eos, eos_penalty, prompt, max_new, max_ngram, max_draft):
    logits_fn = hash_model(seed, vocab, window, period, eos, eos_penalty)
    model = ContextModel(prompt, logits_fn)
    out = generate_with_speculation(prompt, max_new, eos, model, max_ngram, max_draft)
    greedy_model = ContextModel(prompt, logits_fn)
    assert out == plain_greedy(prompt, max_new, eos, greedy_model)
    assert len(out) <= max_new
    assert eos not in out
    assert model.calls == greedy_model.calls
    assert_fed_once_in_order(model.calls, prompt, out)
    return out


@st.composite
def cases(draw):
    vocab = draw(st.integers(2, 6))
    return dict(
        seed=draw(st.integers(0, 2**32)),
        vocab=vocab,
        window=draw(st.integers(1, 3)),
        period=draw(st.integers(1, 3)),
        eos=draw(st.one_of(st.none(), st.integers(0, vocab - 1))),
        eos_penalty=draw(st.sampled_from([0.0, 1.0, 2.0, 3.5])),
        prompt=draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=20)),
        max_new=draw(st.integers(0, 30)),
        max_ngram=draw(st.integers(2, 5)),
        max_draft=draw(st.integers(1, 5)),
    )


@settings(max_examples=150, deadline=None)
@given(cases())
def test_speculation_is_lossless_on_random_models(case):
    run_case(**case)


def test_random_models_cover_every_path(spy):
    """A fixed sweep that must exercise full, partial and immediate rejection, EOS in drafts and budget ends."""
    proposals, verify_log = spy
    rng = random.Random(1234)
    ended_by_eos = ended_by_budget = 0
    for _ in range(150):
        vocab = rng.randint(2, 5)
        eos = rng.choice([None, *range(vocab)])
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
        max_new = rng.randint(1, 30)
        out = run_case(
            seed=rng.randrange(2**32),
            vocab=vocab,
            window=rng.randint(1, 3),
            period=rng.randint(1, 3),
            eos=eos,
            eos_penalty=rng.choice([1.0, 2.0, 3.5]),
            prompt=prompt,
            max_new=max_new,
            max_ngram=rng.randint(2, 5),
            max_draft=rng.randint(1, 5),
        )
        ended_by_budget += len(out) == max_new
        ended_by_eos += len(out) < max_new
    drafted = sum(bool(draft) for draft, _ in proposals)
    full = sum(accepted == size for accepted, size in verify_log)
    partial = sum(accepted < size for accepted, size in verify_log)
    immediate_reject = drafted - len(verify_log)
    eos_cut = sum(cut for _, cut in proposals)
    assert min(full, partial, immediate_reject, eos_cut, ended_by_eos, ended_by_budget) >= 5, (
        full,
        partial,
        immediate_reject,
        eos_cut,
        ended_by_eos,
        ended_by_budget,
    )


class CountingTokens(Sequence[int]):
    """A long token sequence that counts element reads and refuses to be iterated (copied) whole."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.reads = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            raise AssertionError("speculate() must not slice the context")
        self.reads += 1
        return self.tokens[index]

    def __iter__(self):
        raise AssertionError("speculate() must not copy the whole context")


def test_speculate_reads_only_the_last_max_ngram_tokens():
    spec = NgramSpeculator([1, 2, 3, 4, 5, 6, 7], max_ngram=3, max_draft=2)
    context = CountingTokens([9] * 100_000 + [2, 3, 4])
    assert spec.speculate(context) == [5, 6]
    assert context.reads == 3
