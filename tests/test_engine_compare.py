"""``lattice bench``'s engine comparison end to end on the local engine alone (the bundled model): batch 1, the
concurrency sweep through a real ``lattice serve`` process, the tables and the plot."""

from __future__ import annotations

import json

import pytest

from lattice_inference.cli import build_parser
from lattice_inference.engines.compare import compare

pytest.importorskip("uvicorn")


def test_local_comparison_with_sweep(tmp_path, capsys):
    plot = tmp_path / "engines.png"
    args = build_parser().parse_args(
        ["bench", "--model", "bundled", "--dtype", "float32", "--limit", "2", "--max-new-tokens", "8",
         "--threads", "1", "--sweep", "1,2", "--sweep-requests", "2", "--json", "--plot", str(plot)]
    )  # fmt: skip
    assert compare(args) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["method"]: r for r in report["batch1"]["local"]}
    assert set(rows) == {"greedy", "ngram"}
    assert rows["ngram"]["identical_share"] == 1.0 and rows["greedy"]["tokens_per_s"] > 0
    levels = report["sweep"]["local"]
    assert [lv["clients"] for lv in levels] == [1, 2]
    assert all(lv["tokens"] > 0 and lv["p95_s"] >= lv["p50_s"] > 0 for lv in levels)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not plot.exists()
    else:
        assert plot.stat().st_size > 0
