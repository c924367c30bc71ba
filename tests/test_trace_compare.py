"""``lattice bench --traces --engine local,vllm``: agentic traces replayed through the engine comparison. Runs
without vLLM: the toy model on the local engine, vLLM's side faked at its boundary (`run_batch`); the vLLM-marked
tests run it for real."""

from __future__ import annotations

import json

import pytest

from lattice_inference.api import Generator
from lattice_inference.cli import build_parser
from lattice_inference.engines.compare import compare, summarise, trace_workload
from lattice_inference.engines.compare_report import format_report
from lattice_inference.engines.vllm import batch, runtime
from lattice_inference.errors import ConfigError
from lattice_inference.prompt_codec import PromptCodec
from lattice_inference.traces import encode_traces, load_traces
from lattice_testing.toy import save_toy_model_dir

DOC = "alpha beta gamma delta alpha beta gamma delta"
TRACES = [
    {
        "id": "plain",
        "requests": [
            {"prompt": f"Read: {DOC}"},
            {"prompt": f"Read again: {DOC}", "max_new_tokens": 5},
            {"prompt": f"Read: {DOC}"},
        ],
    },
    {
        "id": "talk",
        "conversation": True,
        "requests": [
            {"messages": [{"role": "user", "content": DOC}]},
            {"messages": [{"role": "user", "content": "and again"}]},
        ],
    },
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_toy_model_dir(tmp_path_factory.mktemp("m"), "llama", init_std=0.02, seed=3)


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in TRACES))
    return path


def test_encode_traces_answers_conversations_only(model, trace_file):
    codec = PromptCodec.from_folder(model)
    traces = load_traces(trace_file)
    asked: list[int] = []

    def answer(ids: list[int], budget: int) -> str:
        asked.append(budget)
        return "delta"

    plain, talk = encode_traces(traces, codec, 7, answer)
    assert [budget for _, budget in plain] == [7, 5, 7] and asked == [7, 7]
    assert plain[0][0] == plain[2][0] == codec.encode(f"Read: {DOC}")
    follow_up = [TRACES[1]["requests"][0]["messages"][0], {"role": "assistant", "content": "delta"}]
    assert talk[1][0] == codec.encode_messages([*follow_up, {"role": "user", "content": "and again"}])
    with pytest.raises(ConfigError, match="'talk' is a conversation"):
        encode_traces(traces, codec, 7)
    assert len(encode_traces(traces[:1], codec, 7)[0]) == 3  # plain traces need no answers


def test_trace_workload_groups_requests_by_trace_and_starts_a_session_per_trace(model, trace_file):
    work = trace_workload(load_traces(trace_file), PromptCodec.from_folder(model), 7, lambda ids, budget: "x")
    assert work.groups == {"plain": {0, 1, 2}, "talk": {3, 4}}
    assert work.sessions == {0, 3} and work.budgets == [7, 5, 7, 7, 7] and len(work.ids) == 5


def test_summarise_reports_speedups_over_the_engines_own_greedy_and_ngram():
    results = {
        "greedy": [([1, 2, 3, 4], 2.0, 0, 0, 0)],
        "ngram": [([1, 2, 3, 4], 1.0, 2, 6, 3)],
        "suffix": [([1, 2, 3, 5], 0.5, 1, 4, 2)],
    }
    rows = {r["method"]: r for r in summarise(results)}
    assert rows["ngram"]["speedup_vs_greedy"] == 2.0 and rows["suffix"]["speedup_vs_ngram"] == 2.0
    assert rows["ngram"]["mean_acceptance_length"] == 2.5 and rows["ngram"]["acceptance_rate"] == 0.5
    assert rows["greedy"]["mean_acceptance_length"] is None and rows["greedy"]["speedup_vs_greedy"] == 1.0
    assert rows["suffix"]["identical_share"] == 0.0 and rows["ngram"]["identical_share"] == 1.0
    assert summarise({"greedy": results["greedy"]})[0]["speedup_vs_ngram"] is None


class FakeVllm:
    """`run_batch` standing in for vLLM: records each run's method and requests, answers greedy's ids echoed."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, list[int], bool]] = []

    def __call__(self, rt, model, runs, eos, **kwargs):
        out = []
        for run in runs:
            self.runs.append((run.options.method, [r.max_new_tokens for r in run.requests], run.warmup))
            spec = {} if run.options.method == "greedy" else {"drafts": 2, "drafted_tokens": 4, "accepted_tokens": 2}
            out.append([batch.VllmOutput([3] * r.max_new_tokens, "", "length", 0.5, 1, spec) for r in run.requests])
        return out


def test_traces_through_both_engines(model, trace_file, monkeypatch, capsys):
    fake = FakeVllm()
    monkeypatch.setattr(runtime, "find_runtime", lambda python=None: runtime.VllmRuntime("python", True, "0"))
    monkeypatch.setattr(runtime, "vllm_model", lambda model, dtype: None)
    monkeypatch.setattr(batch, "run_batch", fake)
    cleared: list[str] = []  # the local engine clears its cross-request index where each trace begins
    monkeypatch.setattr(Generator, "clear_suffix_index", lambda self: cleared.append(self.method))
    argv = ["bench", "--traces", str(trace_file), "--engine", "local,vllm", "--model", str(model), "--dtype",
            "float32", "--max-new-tokens", "8", "--threads", "1", "--json"]  # fmt: skip
    assert compare(build_parser().parse_args(argv)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["traces"] == 2 and report["prompts"] == 5 and report["methods"] == ["greedy", "ngram", "suffix"]
    local = {r["method"]: r for r in report["batch1"]["local"]}
    assert all(r["identical_share"] == 1.0 and r["runs"] == 5 for r in local.values())
    assert local["greedy"]["speedup_vs_greedy"] == 1.0 and local["suffix"]["speedup_vs_ngram"] > 0
    assert cleared.count("suffix") == 3  # once per rep, then at each of the two traces
    assert fake.runs == [(m, [8, 5, 8, 8, 8], True) for m in ("greedy", "ngram", "suffix")]
    vllm = {r["method"]: r for r in report["batch1"]["vllm"]}
    assert vllm["suffix"]["mean_acceptance_length"] == 2.0 and vllm["ngram"]["tokens_per_s"] == 37 / 2.5
    assert set(report["batch1_sets"]) == {"plain", "talk"}
    assert [r["runs"] for r in report["batch1_sets"]["talk"]["vllm"]] == [2, 2, 2]
    assert report["sweep"] == {}
    text = format_report(report)
    assert "2 traces, 5 requests in order" in text and "-- batch 1, trace talk only --" in text


def test_a_trace_replay_runs_once(trace_file):
    args = build_parser().parse_args(["bench", "--traces", str(trace_file), "--engine", "local,vllm", "--reps", "2"])
    with pytest.raises(ConfigError, match="--reps 2 with --traces"):
        compare(args)


def test_local_trace_bench_replays_every_request(model, trace_file, capsys):
    """``lattice bench --traces FILE`` on the local engine alone: per trace and overall, every method's output is
    greedy's, conversations included."""
    from lattice_inference.cli import main

    argv = ["bench", "--traces", str(trace_file), "--model", str(model), "--max-new-tokens", "8", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 5 and set(report["traces"]) == {"plain", "talk"}
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"greedy", "ngram", "suffix"} and all(r["identical_share"] == 1.0 for r in rows.values())
    assert rows["greedy"]["new_tokens"] <= 8 + 5 + 8 + 8 + 8
