"""`bench/bench_peers.py`'s summary over rows a peer left incomplete: it must summarise what was measured, never
fail (a ``ZeroDivisionError`` there once lost 14 minutes of rows), and mark what it cannot compare."""

from __future__ import annotations

from types import SimpleNamespace

from .helpers import bench_module


def _bench_peers():
    return bench_module("bench_peers")


def _row(prompt: int, rep: int, ids: list[int], seconds: float) -> dict:
    return {"prompt": prompt, "rep": rep, "token_ids": ids, "seconds": seconds}


def test_a_peer_missing_a_prompt_set_or_a_reference_row_is_summarised_without_failing():
    peers = _bench_peers()
    prompts = [SimpleNamespace(set=None, kind="grounded"), SimpleNamespace(set=None, kind="chat")]
    results = {
        "ours greedy": [_row(0, 0, [1, 2], 1.0), _row(1, 0, [3, 4], 1.0), _row(0, 1, [1, 2], 0.5)],
        "ours ngram": [_row(0, 0, [1, 2], 0.5), _row(1, 0, [3, 5], 0.5)],
        "llama.cpp": [_row(0, 0, [1, 2], 0.0)],  # a zero time, and no chat row: the peer stopped after one prompt
    }
    table = peers.summarise(results, prompts, "ours greedy")
    assert set(table) == {"all", "grounded", "chat"}
    assert "llama.cpp" not in table["chat"]["engines"] and "llama.cpp" not in table["all"]["engines"]
    ngram = table["all"]["engines"]["ours ngram"]
    assert ngram["tokens_per_s"] == 4.0 and ngram["speedup"] == 2.0
    assert ngram["identical"] == ngram["identical_to_own_plain"] == 0.5
    assert table["grounded"]["engines"]["ours greedy"]["tokens_per_s"] == 3.0  # median of reps: 2 and 4 tok/s
    assert peers._fmt(None, ".2f", 5) == "    -"
