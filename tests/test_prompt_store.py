"""The prompt cache on disk: a later process's prefill takes a saved prompt's rows, bit for bit what it would compute,
and refuses files of another model, dtype or thread count, or unreadable ones, with one line each."""

from __future__ import annotations

import random

import pytest
import torch

from lattice_inference.errors import ConfigError
from lattice_inference.targets import LeanTarget, make_target
from lattice_inference.targets.prompt_store import MIN_ROWS, PromptStore, model_fingerprint
from lattice_testing.toy import toy_config, toy_model


def _model(seed: int = 1, dtype: torch.dtype = torch.float32):
    return toy_model(toy_config("qwen2"), init_std=0.3, seed=seed).to(dtype)


def _reusable(target: LeanTarget) -> bool:
    return target._row_key("") is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_new_process_takes_the_saved_rows_bit_for_bit(tmp_path, dtype, capsys):
    model = _model(dtype=dtype)
    first = LeanTarget(model, prompt_cache=str(tmp_path))
    if not _reusable(first):
        pytest.skip("this CPU computes these prefills with row-count-dependent products: nothing is reusable")
    rng = random.Random(0)
    document = [rng.randrange(256) for _ in range(MIN_ROWS + 30)]
    seq = first.new_sequence()
    first.prefill(seq, [*document, 7])
    for token in (8, 9, 10):
        first.forward(seq, [token])
    first.release(seq)
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1
    later = LeanTarget(_model(dtype=dtype), prompt_cache=str(tmp_path))  # the same weights, another "process"
    fresh = LeanTarget(model, prefix_cache=False)
    question = [*document, 7, 8, 9, 42, 43]
    mine, theirs = later.new_sequence(), fresh.new_sequence()
    later.prefill(mine, [3, 1, 4, 1, 5])  # rows of another prompt first: kept once, with their cache, when replaced
    assert torch.equal(later.prefill(mine, question), fresh.prefill(theirs, question))
    assert [(rows.tokens, cache is not None) for rows, cache in later._kept._kept] == [([3, 1, 4, 1, 5], True)]
    assert mine.reused == len(document) + 3 and later.prompt_store is not None
    assert later.prompt_store.loaded == len(document) + 3
    for token in (5, 6):
        assert torch.equal(later.forward(mine, [token]), fresh.forward(theirs, [token]))
    later.release(mine)  # departs from the first file's rows after 8, 9: a file of its own
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    longer = later.new_sequence()
    later.prefill(longer, [*question, 5, 6, 1])
    later.release(longer)  # holds the second file's rows and more: it replaces it
    assert len(list(tmp_path.glob("*.safetensors"))) == 2 and files[0].exists()
    assert "not using" not in capsys.readouterr().err


def test_files_of_another_model_dtype_or_thread_count_are_refused_in_one_line(tmp_path, capsys):
    first = LeanTarget(_model(seed=1), prompt_cache=str(tmp_path))
    if not _reusable(first):
        pytest.skip("this CPU computes these prefills with row-count-dependent products: nothing is reusable")
    prompt = list(range(MIN_ROWS + 10))
    seq = first.new_sequence()
    first.prefill(seq, prompt)
    first.release(seq)
    other = LeanTarget(_model(seed=2), prompt_cache=str(tmp_path))  # another checkpoint of the same shapes
    assert other.prompt_store is not None and first.prompt_store is not None
    assert other.prompt_store.identity["model"] != first.prompt_store.identity["model"]
    seq = other.new_sequence()
    other.prefill(seq, prompt)
    assert seq.reused == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "not using" in lines[0] and "another model" in lines[0], lines
    other.prefill(seq, [*prompt, 1])  # refused once: not read again
    assert capsys.readouterr().err == ""
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        third = LeanTarget(_model(seed=1), prompt_cache=str(tmp_path))
        seq = third.new_sequence()
        third.prefill(seq, prompt)
        assert seq.reused == 0 and "threads" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    seq = first.new_sequence()
    first.prefill(seq, [*prompt, 3])
    assert seq.reused == len(prompt)  # the good file still serves
    assert "broken.safetensors: it cannot be read" in capsys.readouterr().err


def test_the_folder_is_bounded_least_recently_used_first(tmp_path):
    identity = {"model": "m"}
    store = PromptStore(tmp_path, identity, max_bytes=1)
    layers = [(torch.zeros(1, 2, MIN_ROWS, 8), torch.zeros(1, 2, MIN_ROWS, 8))]
    first = store.save(list(range(MIN_ROWS)), layers)
    assert first is not None and not first.exists()  # over the bound at once: dropped
    store.max_bytes = 3 * first.parent.stat().st_size + 10**6
    a = store.save(list(range(MIN_ROWS)), layers)
    b = store.save(list(range(1, MIN_ROWS + 1)), layers)
    assert a is not None and b is not None and a.exists() and b.exists()
    assert store.save(list(range(MIN_ROWS)), layers) is None  # held already
    assert store.save(list(range(MIN_ROWS - 1)), layers) is None  # too short
    store.max_bytes = a.stat().st_size + 100
    assert store.best(list(range(MIN_ROWS + 5)))[1] == MIN_ROWS
    store.load(a, 10, torch.device("cpu"))  # a is now the most recently used
    c = store.save(list(range(2, MIN_ROWS + 2)), layers)
    assert c is not None
    left = set(tmp_path.glob("*.safetensors"))
    assert len(left) == 1 and not list(tmp_path.glob("*.partial"))


def test_the_fingerprint_tells_checkpoints_apart_and_other_targets_refuse_a_prompt_cache(tmp_path):
    assert model_fingerprint(_model(seed=1)) == model_fingerprint(_model(seed=1))
    assert model_fingerprint(_model(seed=1)) != model_fingerprint(_model(seed=2))
    with pytest.raises(ConfigError, match="--prompt-cache needs the lean forward"):
        make_target(_model(), forward="transformers", prompt_cache=str(tmp_path))
