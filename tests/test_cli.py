"""The ``lattice`` command end to end on a toy model directory, including every bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lattice_inference.cli import main
from lattice_inference.devices import resolve_device
from lattice_testing.toy import save_toy_model_dir

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add("


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_toy_model_dir(tmp_path_factory.mktemp("toy") / "model", "qwen3", init_std=0.02, seed=1))


def run_json(capsys, *args: str) -> dict:
    assert main(["generate", *args, "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out)


def test_json_output_and_ngram_equals_greedy(model_dir, capsys):
    common = ["--model", model_dir, "--prompt", PROMPT, "--max-new-tokens", "48", "--dtype", "float32", "--no-chat"]
    greedy = run_json(capsys, *common, "--method", "greedy")
    ngram = run_json(capsys, *common, "--method", "ngram", "--max-draft", "6", "--fixed-draft", "--device", "cpu")
    assert ngram["token_ids"] == greedy["token_ids"]
    assert (ngram["device"], ngram["dtype"]) == ("cpu", "float32")
    assert greedy["device"].split()[0] == str(resolve_device("auto"))  # the default: the first GPU, else the CPU
    assert ngram["text"] == greedy["text"]
    assert len(ngram["token_ids"]) <= 48
    m = ngram["metrics"]
    for key in (
        "prompt_tokens",
        "new_tokens",
        "target_forwards",
        "drafts",
        "drafted_tokens",
        "accepted_tokens",
        "acceptance_rate",
        "mean_acceptance_length",
        "accepted_per_position",
        "prefill_s",
        "decode_s",
        "tokens_per_s",
    ):
        assert key in m, key
    assert m["new_tokens"] == len(ngram["token_ids"])
    assert m["prompt_tokens"] == len(PROMPT.encode())
    assert m["target_forwards"] < greedy["metrics"]["target_forwards"]
    assert greedy["metrics"]["drafts"] == 0
    assert max(m["draft_lengths"]) <= 6 and sum(m["draft_lengths"]) == m["drafted_tokens"]
    adaptive = run_json(capsys, *common, "--method", "ngram", "--max-draft", "6")
    assert adaptive["token_ids"] == greedy["token_ids"]
    assert max(adaptive["metrics"]["draft_lengths"]) <= 6


def test_penalties_reach_the_decoder_and_stay_lossless(model_dir, capsys):
    """``--repetition-penalty`` etc. change the text the same way with and without speculation, and equal the
    Python API's."""
    from lattice_inference import Generator

    common = ["--model", model_dir, "--prompt", PROMPT, "--max-new-tokens", "32", "--dtype", "float32", "--no-chat"]
    flags = ["--repetition-penalty", "1.4", "--frequency-penalty", "0.5", "--presence-penalty", "0.3"]
    plain = run_json(capsys, *common, "--method", "greedy")
    greedy = run_json(capsys, *common, *flags, "--method", "greedy")
    ngram = run_json(capsys, *common, *flags, "--method", "ngram")
    assert ngram["token_ids"] == greedy["token_ids"] != plain["token_ids"]
    api = Generator.from_pretrained(model_dir, dtype="float32", method="greedy")
    penalties = dict(repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.3)
    assert api.generate(PROMPT, 32, **penalties).token_ids == greedy["token_ids"]


def test_streams_text_and_prints_one_metrics_line(model_dir, capsys):
    assert main(["generate", "--model", model_dir, "--prompt", PROMPT, "--max-new-tokens", "20"]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "tok/s" in lines[0] and "acceptance" in lines[0]
    assert captured.out.endswith("\n")


def test_prompt_file_and_chat(model_dir, tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text(PROMPT)
    a = run_json(capsys, "--model", model_dir, "--prompt-file", str(f), "--max-new-tokens", "8")
    b = run_json(capsys, "--model", model_dir, "--prompt", PROMPT, "--max-new-tokens", "8")
    assert a["token_ids"] == b["token_ids"]
    c = run_json(capsys, "--model", model_dir, "--prompt", PROMPT, "--max-new-tokens", "8", "--chat")
    raw = run_json(capsys, "--model", model_dir, "--prompt", PROMPT, "--max-new-tokens", "8", "--no-chat")
    assert c["metrics"]["prompt_tokens"] > raw["metrics"]["prompt_tokens"] == len(PROMPT.encode())
    # The toy tokenizer has a chat template, so the default wraps the prompt in it.
    assert b["metrics"]["prompt_tokens"] == c["metrics"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/model"], "does not exist"),
        (["--model", "{tmp}"], "no config.json"),
        (["--prompt", "   "], "prompt is empty"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read prompt file"),
        (["--max-new-tokens", "5000"], "exceeds the model's 2048 positions"),
        (["--min-ngram", "4", "--max-ngram", "3"], "--min-ngram (4) is larger than --max-ngram (3)"),
        (["--method", "beam"], "unknown method 'beam'"),
        (["--repetition-penalty", "0"], "repetition_penalty must be a finite number > 0"),
        (["--presence-penalty", "3"], "presence_penalty must be a number in [-2, 2]"),
        (["--frequency-penalty", "lots"], "--frequency-penalty must be a number"),
        (["--device", "gpu"], "unknown device 'gpu'; choose auto, cpu, cuda or cuda:N"),
        (["--device", "cuda:99"], "device 'cuda:99': "),  # a CPU build, no GPU, or no 100th GPU: each said
    ],
)
def test_bad_input_one_line_error(model_dir, tmp_path, capsys, args, message):
    base = {"--model": model_dir, "--prompt": PROMPT}
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    for flag, value in base.items():
        if flag not in args and not (flag == "--prompt" and "--prompt-file" in args):
            args = [flag, value, *args]
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flag", ["--max-new-tokens", "--max-draft", "--max-ngram", "--min-ngram"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_non_positive_options_rejected(model_dir, capsys, flag, value):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", model_dir, "--prompt", PROMPT, flag, value])
    assert exc.value.code == 2
    assert "must be at least 1" in capsys.readouterr().err


def test_max_leaves_takes_zero_and_refuses_negatives(model_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", model_dir, "--prompt", PROMPT, "--max-leaves", "-1"])
    assert exc.value.code == 2
    assert "must be at least 0, got -1" in capsys.readouterr().err
    out = run_json(capsys, "--model", model_dir, "--prompt", PROMPT, "--max-new-tokens", "8", "--max-leaves", "0")
    assert out["metrics"]["leaves"] == 0


def test_max_leaves_option_is_checked_once():
    from lattice_inference.errors import ConfigError
    from lattice_inference.options import DecodeOptions

    assert DecodeOptions(max_leaves=0).max_leaves == 0
    for bad in (-1, 17, 2.5, True):
        with pytest.raises(ConfigError, match=f"max_leaves must be an integer 0..16, got {bad!r}"):
            DecodeOptions(max_leaves=bad)


def test_console_script_no_traceback(model_dir):
    """The installed command exits non-zero with one line and no traceback on a bad directory."""
    proc = subprocess.run(
        [sys.executable, "-m", "lattice_inference.cli", "generate", "--model", "/nope", "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("lattice: error: model '/nope' does not exist (expected")
    assert "\n" not in proc.stderr.strip()
