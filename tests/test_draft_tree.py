"""Draft trees: runners-up verified as leaves beside a draft, in one forward, losslessly.

The tree forward's rows equal plain forwards of each row's path; keeping a path leaves the cache exactly as
decoding that path would; trees are refused where cache rows cannot move (sliding windows, recurrent state).
End to end, on every toy architecture, trees whose leaves hold the true token at random ranks (or not at all)
decode token for token what transformers' greedy search and keyed sampling emit, EOS included; the planner
chooses leaves only where they pay and learns how often runners-up hold.
"""

from __future__ import annotations

import random

import pytest
import torch

from lattice_inference.decode import SpeculativeDecoder
from lattice_inference.draft_planner import DraftPlanner
from lattice_inference.sampling import GreedySampler, KeyedSampler, SamplingOptions
from lattice_inference.targets import HybridTarget, TransformersTarget
from lattice_inference.targets.facts import ForwardCosts
from lattice_inference.verify import DraftTree
from lattice_testing.toy import TOY_ARCHITECTURES, TOY_VOCAB, toy_config, toy_model

from .helpers import TreeOracleDrafter, hf_generate, hf_plain
from .test_hybrid_target import build_model

TREE_ARCHES = ("qwen3", "llama", "qwen2", "gemma", "phi3")
FLAT = ForwardCosts((1, 16), (1.0, 1.0))  # verification is free: the planner takes every leaf it is offered


def test_tree_rows_put_the_draft_first_and_leaves_by_depth():
    tree = DraftTree([10, 11, 12], [[20, 21], [], [22]])
    tokens, parents, depths = tree.rows(9)
    assert tokens == [9, 10, 11, 12, 20, 21, 22]
    assert parents == [-1, 0, 1, 2, 0, 0, 2]
    assert depths == [0, 1, 2, 3, 1, 1, 3]


@pytest.mark.parametrize(
    ("choices", "accepted", "tokens", "path"),
    [
        ([10, 11, 12, 13, 0, 0, 0], 3, [10, 11, 12, 13], [0, 1, 2, 3]),  # the whole draft
        ([21, 0, 0, 0, 0, 5, 0], 1, [21, 5], [0, 5]),  # a leaf at once, its row chooses the bonus
        ([10, 11, 22, 0, 0, 0, 7], 3, [10, 11, 22, 7], [0, 1, 2, 6]),  # a leaf at the last depth
        ([10, 30, 0, 0, 0, 0, 0], 1, [10, 30], [0, 1]),  # depth 1 has no leaves: a plain rejection
        ([31, 0, 0, 0, 0, 0, 0], 0, [31], [0]),  # no leaf holds: the correction
    ],
)
def test_tree_verdicts(choices, accepted, tokens, path):
    verdict = DraftTree([10, 11, 12], [[20, 21], [], [22]]).verify(choices)
    assert (verdict.accepted, verdict.tokens, verdict.path) == (accepted, tokens, path)
    assert verdict.on_draft == accepted - (path != list(range(len(path))))


def test_bad_trees_are_refused():
    with pytest.raises(ValueError, match="distinct"):
        DraftTree([10, 11], [[10]])
    with pytest.raises(ValueError, match="distinct"):
        DraftTree([10, 11], [[4, 4]])
    with pytest.raises(ValueError, match="3 alternative lists for a draft of 2"):
        DraftTree([10, 11], [[1], [2], [3]])
    with pytest.raises(ValueError, match="need 4 target choices"):
        DraftTree([10, 11], [[1]]).verify([1, 2, 3])


def path_of(row: int, tokens: list[int], parents: list[int]) -> list[int]:
    path = []
    while row >= 0:
        path.append(tokens[row])
        row = parents[row]
    return path[::-1]


@pytest.mark.parametrize("arch", TREE_ARCHES)
def test_tree_rows_equal_each_paths_forward_and_a_kept_path_is_plain_decoding(arch):
    model = toy_model(toy_config(arch), init_std=0.5, seed=3)
    target, ref = TransformersTarget(model), TransformersTarget(model)
    assert target.verifies_trees
    seq, ref_seq = target.new_sequence(capture_hidden=True), ref.new_sequence(capture_hidden=True)
    prompt = [random.Random(arch).randrange(256) for _ in range(17)]
    tokens, parents = [5, 6, 7, 8, 9, 10, 11], [-1, 0, 1, 0, 1, 3, 0]
    target.prefill(seq, prompt)
    logits = target.forward_tree(seq, tokens, parents)
    hidden = seq.hidden.clone()
    for row in range(len(tokens)):
        ref.prefill(ref_seq, prompt)
        want = ref.forward(ref_seq, path_of(row, tokens, parents))[-1]
        torch.testing.assert_close(logits[row], want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hidden[row], ref_seq.hidden[-1], atol=1e-4, rtol=1e-4)
    target.keep_rows(seq, len(prompt), [0, 3, 5])
    assert seq.length == len(prompt) + 3
    after = target.forward(seq, [12, 13])
    ref.prefill(ref_seq, prompt)
    torch.testing.assert_close(after, ref.forward(ref_seq, [5, 8, 10, 12, 13])[-2:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_trees_are_refused_where_cache_rows_cannot_move(arch):
    target = TransformersTarget(toy_model(toy_config(arch), seed=1))
    assert not target.verifies_trees
    seq = target.new_sequence()
    target.prefill(seq, [1, 2, 3])
    with pytest.raises(NotImplementedError, match="does not verify draft trees"):
        target.forward_tree(seq, [4, 5, 6], [-1, 0, 0])
    target.forward(seq, [4, 5, 6])
    with pytest.raises(NotImplementedError, match="keeps only a prefix"):
        target.keep_rows(seq, 3, [0, 2])
    target.keep_rows(seq, 3, [0, 1])
    assert seq.length == 5


def test_hybrid_targets_do_not_verify_trees():
    assert not HybridTarget(build_model("qwen3_5")).verifies_trees


def test_malformed_trees_name_the_problem_and_change_nothing():
    target = TransformersTarget(toy_model(toy_config("llama"), seed=1))
    seq = target.new_sequence()
    target.prefill(seq, [1, 2, 3])
    with pytest.raises(ValueError, match="row 0 is its only root"):
        target.forward_tree(seq, [4, 5], [0, 0])
    with pytest.raises(ValueError, match="row 2 of a draft tree must follow an earlier row, got parent 2"):
        target.forward_tree(seq, [4, 5, 6], [-1, 0, 2])
    with pytest.raises(ValueError, match="3 tokens needs 3 parents, got 2"):
        target.forward_tree(seq, [4, 5, 6], [-1, 0])
    assert seq.length == 3
    target.forward_tree(seq, [4, 5, 6], [-1, 0, 0])
    with pytest.raises(ValueError, match="must increase from 0"):
        target.keep_rows(seq, 3, [0, 2, 1])
    assert seq.length == 6


def _oracle_run(model, prompt, reference, eos, sampling, seed, new=30):
    drafter = TreeOracleDrafter(prompt + reference, TOY_VOCAB, seed=seed)
    dec = SpeculativeDecoder(
        TransformersTarget(model),
        drafter,
        max_draft=4,
        eos_token_ids=[] if eos is None else [eos],
        adaptive=True,
        costs=FLAT,
    )
    return dec.generate(prompt, new, sampling)


@pytest.mark.parametrize("arch", TOY_ARCHITECTURES)
def test_tree_decoding_equals_greedy(arch):
    """Leaves hold the true token at random ranks or not at all; sliding-window models verify the draft alone."""
    model = toy_model(toy_config(arch), init_std=0.5, seed=7)
    rng = random.Random(arch)
    leaves = on_leaf = eos_stops = 0
    for i in range(4):
        prompt = [rng.randrange(256) for _ in range(rng.randint(3, 30))]
        free = hf_generate(model, prompt, 36, None)
        eos = free[20] if i % 2 else None  # a token greedy really emits: the tree may hold it anywhere
        want = hf_generate(model, prompt, 30, eos)
        got = _oracle_run(model, prompt, free, eos, None, seed=i)
        assert got.token_ids == want, (arch, i)
        leaves += got.metrics.leaves
        on_leaf += got.metrics.accepted_leaves
        eos_stops += got.stop_reason == "eos"
    assert eos_stops > 0
    if arch in TREE_ARCHES:
        assert leaves > 0 and on_leaf > 0
    else:
        assert leaves == on_leaf == 0


#: Penalties on: each tree row is penalised by its own path (`lattice_inference.penalties`).
PENALTIES = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.6)


@pytest.mark.parametrize(
    ("arch", "penalties"), [("qwen3", {}), ("llama", {}), ("phi3", {}), ("qwen3", PENALTIES), ("llama", PENALTIES)]
)
def test_tree_decoding_equals_keyed_sampling(arch, penalties):
    """Keyed sampling (and, with penalties, greedy decoding too) through trees equals transformers' plain run."""
    model = toy_model(toy_config(arch), init_std=0.3, seed=11)
    rng = random.Random(arch)
    temperatures = (0.7, 0.0, 1.5, 0.0) if penalties else (0.7, 1.0, 1.5, 0.3)
    on_leaf = 0
    for i in range(4):
        prompt = [rng.randrange(256) for _ in range(rng.randint(3, 30))]
        opts = SamplingOptions(temperature=temperatures[i], top_k=(0, 40, 0, 0)[i], seed=50 + i, **penalties)
        free = hf_plain(model, prompt, 30, None, opts)
        got = _oracle_run(model, prompt, free, None, opts, seed=i)
        assert got.token_ids == free, (arch, i)
        on_leaf += got.metrics.accepted_leaves
    assert on_leaf > 0


def test_planner_takes_leaves_only_where_they_pay():
    free, steep = DraftPlanner(FLAT, max_leaves=4), DraftPlanner(ForwardCosts((1, 2, 8), (1.0, 1.6, 6.0)), max_leaves=4)
    k, leaves = free.choose_tree(2, 1, drafted=1, runners_up=3)
    assert k == 2 and sum(leaves) >= 3 and leaves[0] >= leaves[1]  # the first depth is reached more often
    assert steep.choose_tree(2, 1, drafted=1, runners_up=3)[1] == [0] * steep.choose_tree(2, 1, drafted=1)[0]
    plain = DraftPlanner(FLAT)
    assert plain.choose_tree(2, 1, drafted=1, runners_up=3) == (plain.choose(2, 1, free=False, drafted=1), [0, 0])


def test_planner_learns_how_often_runners_up_hold():
    planner = DraftPlanner(ForwardCosts((1, 2, 8), (1.0, 1.1, 1.8)), max_leaves=4)
    before = planner.alternative(0, 0, key=2)
    for _ in range(30):
        planner.record_runners_up([[7, 8, 9]], 0, 7, key=2)
    assert planner.alternative(0, 0, key=2) > 0.8 > before
    assert planner.alternative(0, 1, key=2) < before
    assert planner.alternative(0, 0, key=3) > before  # other keys of the drafter share the estimate, weighted
    assert planner.alternative(0, 0, key=102) == before  # another drafter's keys do not
    for _ in range(30):  # a hopeless draft token whose first runner-up always holds: verify it beside the draft
        planner.record([5], 1, 0, 7, key=2)
    k, leaves = planner.choose_tree(1, 2, drafted=1, runners_up=3)
    assert (k, leaves[0] >= 1) == (1, True)


@pytest.mark.parametrize("sampler", [GreedySampler(), KeyedSampler(SamplingOptions(temperature=0.8, seed=3), 50)])
def test_ranked_drafts_start_with_the_chosen_draft(sampler):
    scores, ids = torch.randn(20), torch.arange(30, 50)
    for index in range(5):
        ranked = sampler.rank_draft(scores, index, ids, 4)
        assert ranked[0] == sampler.choose_draft(scores, index, ids)
        assert len(set(ranked)) == 4 and set(ranked) <= set(ids.tolist())
    logits = torch.randn(3, 50)
    assert sampler.choose_at(logits, [4, 5, 6]) == sampler.choose(logits, 4)
