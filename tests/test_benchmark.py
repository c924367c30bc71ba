"""``lattice bench`` and its quality measures."""

from __future__ import annotations

import json

import pytest

from lattice_inference import Generator
from lattice_inference.benchmark import (
    BenchPrompt,
    copy_counts,
    copy_rate,
    format_table,
    load_prompts,
    repetition_rate,
    run_bench,
)
from lattice_inference.cli import main
from lattice_inference.errors import ConfigError
from lattice_testing.toy import byte_tokenizer, save_toy_model_dir, toy_config, toy_model


def test_copy_and_repetition_rates():
    assert copy_rate([1, 2, 3, 4], [1, 2, 9, 4, 5]) == 0.6  # the 5th reference token was never produced
    assert copy_rate([1, 2, 3, 4], [1, 2, 9, 4, 5], budget=4) == 0.75
    assert copy_rate([], [1]) == 0.0
    assert copy_rate([1], []) == 0.0
    # output past the reference's end is not compared; an early stop (EOS) misses what it never produced
    assert copy_counts([1, 2, 3, 7, 7, 7], [1, 2, 3], budget=6) == (3, 3)
    assert copy_counts([1, 2], [1, 2, 3, 4], budget=3) == (2, 3)
    assert repetition_rate([1, 2, 3, 4, 5, 6, 7]) == 0.0
    assert repetition_rate([7] * 10) == pytest.approx(6 / 7)
    assert repetition_rate([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 / 5)


def test_prompt_file_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1: expected a JSON object with 'prompt' or 'messages'"):
        load_prompts(bad)
    with pytest.raises(ConfigError, match="cannot read prompts file"):
        load_prompts(tmp_path / "missing.jsonl")


def test_bench_json_reports_identical_outputs(tmp_path, capsys):
    model = save_toy_model_dir(tmp_path / "m", "qwen3", init_std=0.02, seed=2)
    prompts = tmp_path / "p.jsonl"
    rows = [
        {"kind": "copy", "prompt": "one two three one two three one two", "reference_continuation": " three one"},
        {"kind": "free", "prompt": "hello world"},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["bench", "--model", str(model), "--prompts", str(prompts), "--methods", "ngram", "--max-new-tokens", "24"]
    assert main([*argv, "--json", "--reps", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    methods = [r["method"] for r in report["rows"]]
    assert methods == ["greedy", "ngram"]
    assert all(r["identical_share"] == 1.0 for r in report["rows"])
    assert report["rows"][0]["speedup_vs_greedy"] == 1.0
    assert report["rows"][1]["mean_acceptance_length"] >= 1.0
    assert 0.0 <= report["greedy_copy_rate"] <= 1.0
    # one report per prompt kind, each over its own prompts; the copy rate only where references exist
    assert set(report["groups"]) == {"copy", "free"}
    assert report["groups"]["copy"]["prompts"] == 1 and report["groups"]["free"]["prompts"] == 1
    assert report["groups"]["free"]["greedy_copy_rate"] is None
    assert report["groups"]["copy"]["greedy_copy_rate"] == report["greedy_copy_rate"]
    for group in report["groups"].values():
        assert [r["method"] for r in group["rows"]] == ["greedy", "ngram"]
        assert group["rows"][0]["speedup_vs_greedy"] == 1.0
    per_kind_tokens = sum(g["rows"][1]["new_tokens"] for g in report["groups"].values())
    assert per_kind_tokens == report["rows"][1]["new_tokens"]
    table = format_table(report)
    assert "== copy: 1 prompts ==" in table and "== free: 1 prompts ==" in table and "== all prompts" in table
    assert main([*argv]) == 0
    assert "acceptance per position" in capsys.readouterr().out
    assert main([*argv, "--repetition-penalty", "1.3", "--json", "--reps", "1"]) == 0
    penalised = json.loads(capsys.readouterr().out)
    assert all(r["identical_share"] == 1.0 for r in penalised["rows"])
    assert "penalties: repetition_penalty 1.3" in format_table(penalised)
    assert main(["bench", "--model", str(model), "--prompts", str(prompts), "--methods", "beam"]) == 2
    assert "unknown method(s) beam" in capsys.readouterr().err


def test_bench_default_methods_skip_mtp_without_a_head(tmp_path, capsys):
    model = save_toy_model_dir(tmp_path / "m", "qwen3", init_std=0.02, seed=2)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "one two one two one"}) + "\n")
    argv = ["bench", "--model", str(model), "--prompts", str(prompts), "--max-new-tokens", "8", "--json"]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert [r["method"] for r in json.loads(out.out)["rows"]] == ["greedy", "ngram"]
    assert "no MTP methods:" in out.err
    assert main([*argv, "--methods", "ngram+mtp"]) == 2  # asked for explicitly: an error, not a skip
    assert "lattice: error:" in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from lattice_inference.benchmark import plot

    row = {"method": "greedy", "speedup_vs_greedy": 1.0, "acceptance_per_position": []}
    fast = {"method": "ngram", "speedup_vs_greedy": 2.0, "acceptance_per_position": [0.9, 0.5]}
    group = {"rows": [row, fast]}
    plot({"rows": [row, fast], "groups": {"copy": group, "free": group}}, tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_conversations_sets_and_samples(tmp_path, capsys):
    """Rows with ``messages`` go through the chat template; the report has a group per set and per kind, and
    ``--show`` prints greedy's output for the first prompt of each kind."""
    model = save_toy_model_dir(tmp_path / "m", "llama", init_std=0.02, seed=3)
    doc = "alpha beta gamma delta alpha beta gamma delta alpha beta"
    rows = [
        {"id": "q1", "set": "grounded", "kind": "qa", "messages": [{"role": "user", "content": doc}]},
        {
            "id": "t1",
            "set": "grounded",
            "kind": "multi_turn",
            "messages": [
                {"role": "user", "content": doc},
                {"role": "assistant", "content": "alpha beta"},
                {"role": "user", "content": "again"},
            ],
        },
        {"id": "c1", "set": "chat", "kind": "chat", "messages": [{"role": "user", "content": "hello there"}]},
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["bench", "--model", str(model), "--prompts", str(prompts), "--methods", "ngram", "--max-new-tokens", "12"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["groups"]) == {"grounded", "chat", "qa", "multi_turn"}
    assert report["groups"]["grounded"]["prompts"] == 2 and report["groups"]["chat"]["prompts"] == 1
    assert set(report["samples"]) == {"qa", "multi_turn", "chat"}
    assert report["samples"]["multi_turn"]["id"] == "t1"
    assert report["samples"]["multi_turn"]["prompt_tokens"] > report["samples"]["qa"]["prompt_tokens"]
    assert all(s["identical"]["ngram"] for s in report["samples"].values())
    assert main([*argv, "--show"]) == 0
    shown = capsys.readouterr().out
    assert "== sample output, qa: q1" in shown and "ngram same" in shown
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": []}) + "\n")
    assert main(["bench", "--model", str(model), "--prompts", str(bad)]) == 2
    assert "'messages' must be a non-empty list" in capsys.readouterr().err


def test_suffix_index_starts_empty_in_every_rep():
    """A suffix method drafts from earlier prompts' answers within a repetition, never from its own answer to the
    same prompt in the warm-up or an earlier repetition (which would make it a regenerate benchmark)."""
    model, tok = toy_model(toy_config("llama"), init_std=0.02, seed=3), byte_tokenizer()
    generators = {m: Generator(model, tok, method=m) for m in ("greedy", "suffix")}
    prompts = [BenchPrompt(prompt="one two three one two"), BenchPrompt(prompt="abc abd abc")]
    sizes = []
    for reps in (1, 2):
        run_bench(generators, prompts, max_new_tokens=12, reps=reps)
        sizes.append(len(generators["suffix"].suffix_index))
    assert sizes[0] == sizes[1] > 0  # what one repetition added, whatever came before it


def test_bench_concurrency_reports_aggregate_rate_latency_and_identical_answers(tmp_path, capsys):
    model = save_toy_model_dir(tmp_path / "m", "llama", init_std=0.3, seed=4)
    prompts = tmp_path / "p.jsonl"
    texts = ["one two three one two three one", "hello world", "a b c a b c a b", "the cat sat on the mat the"]
    prompts.write_text("".join(json.dumps({"kind": "k", "prompt": t}) + "\n" for t in texts))
    argv = ["bench", "--model", str(model), "--prompts", str(prompts), "--methods", "ngram", "--max-new-tokens", "12"]
    for sampled in ([], ["--temperature", "0.8", "--seed", "3"]):
        assert main([*argv, *sampled, "--concurrency", "1,3", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert [(r["method"], r["concurrency"]) for r in report["rows"]] == [
            ("greedy", 1),
            ("greedy", 3),
            ("ngram", 1),
            ("ngram", 3),
        ]
        for row in report["rows"]:
            assert row["identical_share"] == 1.0 and row["tokens_per_s"] > 0
            assert 0 < row["latency_p50_s"] <= row["latency_p95_s"]
    assert main([*argv, "--concurrency", "2"]) == 0
    assert "clients" in capsys.readouterr().out
    for bad in ("0", "2,2", "x"):
        assert main([*argv, "--concurrency", bad]) == 2
        assert "--concurrency" in capsys.readouterr().err
