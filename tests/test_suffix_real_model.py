"""The suffix method on the real default model (SmolLM2, float32): the packaged agentic edit loop decodes token for
token what plain greedy decodes, and later requests draft from earlier ones. Skipped where the model is absent."""

from __future__ import annotations

import pytest

from lattice_inference import Generator
from lattice_inference.benchmark import encode_prompt
from lattice_inference.loading import load_model
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
