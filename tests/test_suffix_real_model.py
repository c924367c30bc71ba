"""The suffix method on the real default model (SmolLM2, float32): the packaged agentic edit loop decodes token for
token what plain greedy decodes, and later requests draft from earlier ones. Skipped where the model is absent."""

from __future__ import annotations

import pytest

from lattice_inference import Generator
from lattice_inference.benchmark import encode_prompt
from lattice_inference.models.load import load_model
from lattice_inference.traces import AGENTIC_TRACES, load_traces

from .helpers import skip_without_real_model

skip_without_real_model()


@pytest.fixture(scope="module")
def loaded():
    return load_model("smollm2", dtype="float32")


def test_suffix_equals_greedy_on_an_agentic_trace(loaded):
    make = lambda method: Generator(  # noqa: E731
        loaded.model, loaded.tokenizer, method=method, adaptive=False, eos_token_ids=loaded.eos_token_ids
    )
    greedy, suffix = make("greedy"), make("suffix")
    trace = next(t for t in load_traces(AGENTIC_TRACES) if t.id == "edit-loop-textwrap")
    forwards = []
    for request in trace.requests[:3]:
        ids = encode_prompt(greedy, request)
        want = greedy.generate(ids, 32).token_ids
        got = suffix.generate(ids, 32)
        assert got.token_ids == want
        forwards.append(got.metrics.target_forwards)
    assert min(forwards[1:]) < forwards[0]


def test_a_regenerated_answer_is_drafted_in_full_from_its_first_round(loaded):
    """Asked the same question again, the suffix index matches the whole context 32 tokens deep, whose prior
    (`DEEP_PRIORS`) has the planner verify full drafts at once rather than ramp up from the drafter-wide rate the
    first answer taught it; both answers are plain decoding's (costs given: nothing here depends on timing)."""
    from lattice_inference.decode import SpeculativeDecoder
    from lattice_inference.drafters.suffix import SuffixDrafter
    from lattice_inference.drafters.suffix_index import SuffixIndex
    from lattice_inference.targets import make_target
    from lattice_inference.targets.facts import ForwardCosts

    greedy = Generator(loaded.model, loaded.tokenizer, method="greedy", eos_token_ids=loaded.eos_token_ids)
    ids = greedy.encode("Write a short JSON object describing a cat named Tom, with three fields.", chat=True)
    want = greedy.generate(ids, 40).token_ids
    costs = ForwardCosts((1, 2, 11), (1.0, 1.1, 2.0))
    target = make_target(loaded.model)
    index = SuffixIndex(100_000)
    dec = SpeculativeDecoder(
        target, SuffixDrafter(100_000, max_draft=10), eos_token_ids=loaded.eos_token_ids, costs=costs
    )
    first = dec.start(ids, 40, suffix_index=index).result()
    second = dec.start(ids, 40, suffix_index=index).result()
    assert first.token_ids == second.token_ids == want
    assert second.metrics.draft_lengths[0] == min(10, len(want) - 1)
    assert second.metrics.target_forwards <= first.metrics.target_forwards
