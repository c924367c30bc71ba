"""Per-generation drafter state: generations interleaved over ONE drafter object each run exactly as alone.

Output alone would not show a leak (every draft is verified, so a drafter fed another sequence's history still
yields the target's tokens): the checks compare each generation's rounds (the chunks it emitted, one per
verification, whose lengths are what the drafts got accepted) and its draft metrics with its solo run, so a
history, index, MTP cache or sampler shared between the two would show as different rounds.
"""

from __future__ import annotations

import pytest

from lattice_inference.api import mtp_head_for
from lattice_inference.decode import SpeculativeDecoder
from lattice_inference.drafters.base import Drafter, Proposal
from lattice_inference.drafters.fallback import FallbackDrafter
from lattice_inference.drafters.mtp import MtpDrafter
from lattice_inference.drafters.ngram import NgramDrafter
from lattice_inference.drafters.suffix import SuffixDrafter
from lattice_inference.models.load import LoadedModel, load_model
from lattice_inference.sampling import SamplingOptions
from lattice_inference.targets import make_target

NEW = 40
SAMPLED = SamplingOptions(temperature=0.8, seed=7)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("bundled", dtype="float32")


def prompts(loaded: LoadedModel) -> list[list[int]]:
    """Two different prompts, both with text to copy (so lookups draft, from different histories)."""
    texts = [
        "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
        "for i in range(10):\n    print(i)\nfor i in range(10):\n",
    ]
    return [loaded.tokenizer.encode(t) for t in texts]


def decoder(loaded: LoadedModel, drafter: Drafter) -> SpeculativeDecoder:
    """A decoder over its own target (its own KV cache) on the shared model; fixed draft lengths, so the rounds
    depend on the drafts alone."""
    return SpeculativeDecoder(make_target(loaded.model), drafter, max_draft=4, adaptive=False)


def rounds(decoders, prompts, samplings, interleave: bool):
    """Each generation's chunks and result; ``interleave`` steps them round by round, in turn."""
    gens = [dec.start(p, NEW, s) for dec, p, s in zip(decoders, prompts, samplings, strict=True)]
    chunks: list[list[list[int]]] = [[] for _ in gens]
    if interleave:
        live = list(range(len(gens)))
        its = [iter(g) for g in gens]
        while live:
            for i in list(live):
                chunk = next(its[i], None)
                if chunk is None:
                    live.remove(i)
                else:
                    chunks[i].append(chunk)
    else:
        for i, g in enumerate(gens):
            chunks[i] = list(g)
    return chunks, [g.result() for g in gens]


def check_interleaved_equals_solo(loaded, make_drafter, samplings):
    ps = prompts(loaded)
    solo = [rounds([decoder(loaded, make_drafter())], [p], [s], False) for p, s in zip(ps, samplings, strict=True)]
    shared = make_drafter()
    chunks, results = rounds([decoder(loaded, shared) for _ in ps], ps, samplings, True)
    for i, (([want_chunks], [want]), got) in enumerate(zip(solo, results, strict=True)):
        assert got.token_ids == want.token_ids, i
        assert chunks[i] == want_chunks, i  # the same rounds: the same drafts were accepted
        for field in ("drafts", "drafted_tokens", "accepted_tokens", "drafter_forwards"):
            assert getattr(got.metrics, field) == getattr(want.metrics, field), (i, field)
    assert sum(r.metrics.accepted_tokens for r in results) > 0  # the drafter did draft


def test_two_ngram_generations_over_one_drafter_run_as_alone(loaded):
    check_interleaved_equals_solo(loaded, lambda: NgramDrafter(max_ngram=3, min_ngram=1, max_draft=4), [None, None])


def test_two_mtp_generations_over_one_drafter_run_as_alone(loaded):
    """The MTP head's weights are shared; each generation has its own head cache, hiddens and sampler (one
    greedy, one sampled: coupled drafting follows each generation's own keyed noise)."""
    head = mtp_head_for(loaded, draft_length=3)
    check_interleaved_equals_solo(loaded, lambda: MtpDrafter(head, num_drafts=2), [None, SAMPLED])


def test_two_ngram_plus_mtp_and_suffix_generations_run_as_alone(loaded):
    head = mtp_head_for(loaded, draft_length=3)
    check_interleaved_equals_solo(
        loaded, lambda: FallbackDrafter([NgramDrafter(max_draft=4), MtpDrafter(head, num_drafts=2)]), [None, SAMPLED]
    )
    check_interleaved_equals_solo(loaded, lambda: SuffixDrafter(1000, max_draft=4), [SAMPLED, None])


def test_proposal_is_the_tokens_with_their_key():
    drafter = NgramDrafter(max_ngram=3, min_ngram=1, max_draft=3)
    state = drafter.start([5, 6, 7, 1, 5, 6])
    proposal = state.propose(4)
    assert proposal == [7, 1, 5] and isinstance(proposal, Proposal) and proposal.key == 2
    other = drafter.start([1, 2, 3])  # a second state leaves the first as it was
    assert other.propose(4) == [] and state.propose(4) == [7, 1, 5]
    state.extend([7])
    assert state.propose(4).key == 3
