"""Options by scope: what builds a target (`TargetOptions`, checked and built in one place) apart from what each
generator or request sets, and the one check of ``max_batch``."""

from __future__ import annotations

import pytest

from lattice_inference.errors import ConfigError
from lattice_inference.options import MAX_BATCH_ROWS, DecodeOptions, TargetOptions, check_max_batch
from lattice_inference.targets import LeanTarget, target_for
from lattice_testing.toy import toy_config, toy_model


def test_decode_options_name_their_target_and_nothing_per_request_changes_it():
    base = DecodeOptions()
    assert base.target == TargetOptions()
    per_request = base.updated(method="suffix", max_draft=3, temperature=0.7, seed=1, adaptive=False)
    assert per_request.target == base.target and hash(per_request.target) == hash(base.target)
    assert DecodeOptions(batched_verify=True).target == TargetOptions(decode_matched=False)
    cached = DecodeOptions(kv_cache="float16", prefix_budget=0).target
    assert cached == TargetOptions(kv_cache="float16", prefix_budget=0)
    assert DecodeOptions(kv_slots=4).target == TargetOptions(kv_slots=4) != base.target


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"forward": "fast"}, "forward"),
        ({"kv_cache": "int8"}, "kv_cache must be one of"),
        ({"prefix_budget": -1}, "prefix_budget"),
        ({"kv_slots": -1}, "kv_slots must be a number of sequences"),
    ],
)
def test_target_options_are_checked_when_made(changes, message):
    with pytest.raises(ConfigError, match=message):
        TargetOptions(**changes)


def test_a_target_is_built_from_its_options():
    model = toy_model(toy_config("llama"), seed=1)
    target = target_for(model, TargetOptions(decode_matched=False, prefix_cache=False))
    assert isinstance(target, LeanTarget) and not target.decode_matched and not target.prefix_cache


def test_max_batch_is_checked_in_one_place():
    assert check_max_batch(1) == 1 and check_max_batch(MAX_BATCH_ROWS) == MAX_BATCH_ROWS
    for bad in (0, MAX_BATCH_ROWS + 1, True, 2.0):
        with pytest.raises(ConfigError, match=r"--max-batch must be 1\.\.64"):
            check_max_batch(bad, "--max-batch")  # type: ignore[arg-type]
