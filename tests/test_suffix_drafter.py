"""`SuffixDrafter`: lossless across requests (greedy and keyed sampling, chains and trees, every toy architecture),
drafting from earlier requests only within the index it is given."""

from __future__ import annotations

import random

import pytest

from lattice_inference import Generator
from lattice_inference.decode import SpeculativeDecoder
from lattice_inference.drafters.fallback import FallbackDrafter
from lattice_inference.drafters.ngram import NgramDrafter
from lattice_inference.drafters.suffix import LOOKUP, SuffixDrafter, match_key, prefers_lookup
from lattice_inference.drafters.suffix_index import SuffixIndex, SuffixMatch
from lattice_inference.sampling import SamplingOptions
from lattice_inference.targets import TransformersTarget
from lattice_inference.targets.base import TargetSequence
from lattice_inference.targets.facts import ForwardCosts
from lattice_testing.toy import TOY_ARCHITECTURES, byte_tokenizer, toy_config, toy_model

from .helpers import ContextKeyedTarget, hf_generate, hf_sampled

FLAT = ForwardCosts((1, 16), (1.0, 1.0))  # verification is free: the planner verifies every token and leaf
TREE_ARCHES = ("qwen3", "llama", "qwen2", "gemma", "phi3")


def agentic_prompts(rng: random.Random, outputs: list[list[int]]) -> list[int]:
    """A prompt that re-reads an earlier prompt or output (as an agent re-reads a file), edited a little, or
    repeats the latest prompt (a regenerated answer)."""
    if outputs and rng.random() < 0.25:
        return list(outputs[-2])
    if not outputs or rng.random() < 0.3:
        return [rng.randrange(256) for _ in range(rng.randint(4, 24))]
    source = rng.choice(outputs)
    cut = rng.randint(2, max(2, len(source)))
    edit = [rng.randrange(256)] if rng.random() < 0.5 else []
    return source[:cut] + edit


def _run_requests(arch: str, sampling: SamplingOptions | None, std: float, *, trees: bool) -> tuple[int, int, int]:
    """Eight requests through one decoder and one index, each checked against transformers; returns (accepted
    draft tokens, tree leaves verified, leaves accepted)."""
    model = toy_model(toy_config(arch), init_std=std, seed=5)
    target = TransformersTarget(model)
    drafter = SuffixDrafter(budget=400, max_draft=6, eos_token_ids=[255])
    dec = SpeculativeDecoder(target, drafter, max_draft=6, eos_token_ids=[255], adaptive=trees, costs=FLAT)
    index = SuffixIndex(400)
    rng = random.Random(arch)
    history: list[list[int]] = []
    accepted = leaves = on_leaf = 0
    for i in range(8):
        prompt = agentic_prompts(rng, history)
        eos = 255 if i % 3 == 2 else None
        opts = None if sampling is None else SamplingOptions(**{**sampling.to_dict(), "seed": sum(prompt) % 997})
        want = hf_generate(model, prompt, 24, eos) if opts is None else hf_sampled(model, prompt, 24, eos, opts)
        dec.eos_token_ids = frozenset([] if eos is None else [eos])
        got = dec.start(prompt, 24, opts, suffix_index=index).result()
        assert got.token_ids == want, (arch, i)
        history += [prompt, prompt + got.token_ids]
        accepted += got.metrics.accepted_tokens
        leaves += got.metrics.leaves
        on_leaf += got.metrics.accepted_leaves
    assert len(index) <= 400
    return accepted, leaves, on_leaf


@pytest.mark.parametrize("arch", TOY_ARCHITECTURES)
def test_suffix_equals_greedy_across_requests_chains_and_trees(arch):
    accepted, _, _ = _run_requests(arch, None, 0.02, trees=False)
    assert accepted > 0
    _, leaves, _ = _run_requests(arch, None, 0.02, trees=True)
    assert (leaves > 0) == (arch in TREE_ARCHES)  # sliding windows verify chains
    _run_requests(arch, None, 0.5, trees=True)  # diverse output: drafts mostly rejected


@pytest.mark.parametrize("arch", ["qwen3", "llama", "mistral"])
def test_suffix_equals_keyed_sampling_across_requests(arch):
    accepted, _, _ = _run_requests(arch, SamplingOptions(temperature=0.8, top_k=20), 0.3, trees=True)
    assert accepted > 0


class TreeSequence(TargetSequence):
    """A `TreeKeyedTarget`'s sequence: its fed tokens (``cache``) and its last forward's draft tree, if any."""

    tree: tuple[list[int], list[list[int]]] | None = None


class TreeKeyedTarget(ContextKeyedTarget):
    """`ContextKeyedTarget` verifying draft trees row by row (each row's logits from its own path)."""

    verifies_trees = True
    fuses_prefill_and_draft = False

    def new_sequence(self, owner="", *, capture_hidden=False):
        return TreeSequence(self, owner, capture_hidden=capture_hidden)

    def forward_tree(self, seq, token_ids, parents):
        import torch

        base, paths, rows = list(seq.cache), [], []
        for token, parent in zip(token_ids, parents, strict=True):
            paths.append(([] if parent < 0 else paths[parent]) + [token])
            rows.append(self._logits(base + paths[-1]))
        seq.tree = (base, paths)
        return torch.stack(rows)

    def forward(self, seq, token_ids):
        seq.tree = None
        return super().forward(seq, token_ids)

    def keep_rows(self, seq, start, rows):
        if seq.tree is None:
            return super().keep_rows(seq, start, rows)
        base, paths = seq.tree
        seq.cache = base + paths[rows[-1]]
        seq.length = len(seq.cache)


def test_trees_from_branching_continuations_step_onto_a_leaf():
    """The index holds one context followed by two continuations; the target takes the less frequent one, which
    the tree verifies as a leaf in the same forward."""
    target = TreeKeyedTarget(vocab=40, forced={(1, 2): 3, (1, 2, 3): 30, (3, 30): 31, (30, 31): 32})
    index = SuffixIndex(100)
    for tail in ([20, 21], [20, 21], [30, 31]):
        index.begin([1, 2, 3, *tail])
    dec = SpeculativeDecoder(target, SuffixDrafter(100, max_draft=4), max_draft=4, adaptive=True, costs=FLAT)
    got = dec.start([5, 1, 2], 3, suffix_index=index).result()  # prefill: 3; then draft 20 21, leaf 30 beside 20
    assert got.token_ids == target.greedy([5, 1, 2], 3) == [3, 30, 31]
    assert got.metrics.leaves == 1 and got.metrics.accepted_leaves == 1 and got.metrics.target_forwards == 1


def test_later_requests_draft_from_earlier_ones_only_through_the_shared_index():
    target = ContextKeyedTarget(vocab=50, seed=3)
    prompt = [1, 2, 3, 4]
    drafter = SuffixDrafter(1000, max_draft=8)
    dec = SpeculativeDecoder(target, drafter, max_draft=8, adaptive=False)
    shared = SuffixIndex(1000)
    first = dec.start(prompt, 60, suffix_index=shared).result()
    again = dec.start(prompt, 60, suffix_index=shared).result()
    alone = dec.start(prompt, 60).result()  # no index: this request's own tokens only
    assert first.token_ids == again.token_ids == alone.token_ids == target.greedy(prompt, 60)
    assert again.metrics.target_forwards * 4 < first.metrics.target_forwards
    assert alone.metrics.target_forwards == first.metrics.target_forwards
    other = SuffixIndex(1000)
    assert dec.start(prompt, 60, suffix_index=other).result().metrics.target_forwards == first.metrics.target_forwards


def test_generator_keeps_one_index_for_its_generations_and_clears_it():
    model = toy_model(toy_config("llama"), init_std=0.5, seed=2)
    tok = byte_tokenizer()
    gen = Generator(model, tok, method="suffix", adaptive=False, eos_token_ids=[])
    greedy = Generator(model, tok, method="greedy", eos_token_ids=[])
    prompt = [5, 9, 14, 3, 200]
    want = greedy.generate(prompt, 30).token_ids
    first = gen.generate(prompt, 30)
    second = gen.generate(prompt, 30)
    assert first.token_ids == second.token_ids == want
    assert second.metrics.target_forwards < first.metrics.target_forwards
    assert gen.suffix_index is not None and len(gen.suffix_index) == 2 * (len(prompt) + 30)
    gen.clear_suffix_index()
    assert len(gen.suffix_index) == 0
    assert gen.generate(prompt, 30).metrics.target_forwards == first.metrics.target_forwards


def test_suffix_plus_mtp_drafts_with_the_index_first():
    drafter = FallbackDrafter([SuffixDrafter(100), NgramDrafter()])
    index = SuffixIndex(100)
    index.begin([7, 8, 9, 10])
    state = drafter.start([7, 8], suffix_index=index)
    assert state.propose(4) == [9, 10] and state.proposals_by == [1, 0]
    assert drafter.proposes_trees


def test_match_keys_grade_depth_and_agreement():
    assert match_key(SuffixMatch(depth=2, support=1)) == 1
    assert match_key(SuffixMatch(depth=40, support=1)) == 6
    assert match_key(SuffixMatch(depth=2, support=2)) == 11


def test_lookup_drafts_where_the_index_matches_no_deeper():
    """Alone, a request's leftmost occurrence (prompt lookup's ``first`` policy) beats the index's most recent one
    of the same depth; an earlier request matching deeper, or several agreeing occurrences, draft from the index."""
    drafter = SuffixDrafter(1000, max_draft=3)
    prompt = [1, 2, 3, 4, 8, 1, 2, 5, 6, 9, 1, 2]
    state = drafter.start(prompt)
    ngram = NgramDrafter(max_draft=3).start(prompt)
    assert state.propose(3) == ngram.propose(3) == [3, 4, 8]
    assert state.last_from_lookup and state.propose(3).key == LOOKUP + 1
    index = SuffixIndex(1000)
    index.begin([7, 7, 9, 1, 2, 8, 8])  # an earlier request: "9 1 2" matches one token deeper than the lookup's
    state = drafter.start([5, 7, 9, 1, 2], suffix_index=index)
    assert state.propose(3) == [8, 8] and not state.last_from_lookup
    index = SuffixIndex(1000)
    for _ in range(2):  # two earlier occurrences of "1 2" agree on 5
        index.begin([1, 2, 5, 6])
    state = drafter.start([1, 2, 3, 1, 2], suffix_index=index)
    assert state.propose(3) == [5, 6] and not state.last_from_lookup


def test_alone_the_suffix_drafter_copies_at_least_as_deep_as_prompt_lookup():
    """On random single requests, every proposal is prompt lookup's unless the index found a deeper match."""
    rng = random.Random(7)
    drafter = SuffixDrafter(1000, max_draft=5)
    for _ in range(20):
        history = [rng.randrange(6) for _ in range(rng.randint(3, 60))]
        state = drafter.start(history[:2])
        ngram = NgramDrafter(max_draft=5).start(history[:2])
        for tok in history[2:]:
            proposal, lookup = state.propose(5), ngram.propose(5)
            if not state.last_from_lookup and lookup:
                assert state.last_match.depth >= 2
            else:
                assert proposal == lookup
            state.extend([tok])
            ngram.extend([tok])


@pytest.mark.parametrize(
    ("depth", "support", "lookup_depth", "lookup"),
    [(0, 0, 0, False), (0, 0, 2, True), (3, 1, 3, True), (3, 2, 3, False), (4, 1, 3, False), (3, 5, 4, True)],
)
def test_prefers_lookup(depth, support, lookup_depth, lookup):
    assert prefers_lookup(SuffixMatch(depth=depth, support=support), lookup_depth) is lookup
