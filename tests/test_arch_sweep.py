"""Every causal-LM architecture of the pinned transformers, built tiny, saved and loaded as a user's folder.

The fast form (default) checks greedy against ``ngram`` on one prompt per architecture; the full form (marker
``sweep_full``, which CI runs: ``pytest -m sweep_full``) adds ``suffix``, a seeded sample and a batch of three.
Either way nothing may fail: every architecture runs losslessly, is refused at load with one line, or cannot be
built tiny (its reason given); and the number that runs may never fall below `RUNS_FLOOR`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lattice_inference.api import Generator
from lattice_inference.errors import ConfigError
from lattice_testing.arch_sweep import (
    causal_lm_types,
    markdown,
    report,
    run_architecture,
    save_tiny_model,
    sweep,
)

RUNS_FLOOR = 134
"""Architectures that run losslessly in the fast sweep on transformers 5.24 (measured: see README's model table)."""

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def fast():
    return sweep(full=False)


def _failures(results) -> str:
    return "\n".join(f"{r.model_type}: {r.reason}" for r in results if r.status == "failed")


def test_every_architecture_runs_losslessly_or_is_refused_with_one_line(fast):
    print(report(fast))
    assert len(fast) == len(causal_lm_types())
    assert not _failures(fast), _failures(fast)
    for r in fast:
        assert r.status in ("runs", "refused", "unbuildable")
        assert r.reason.strip() == r.reason and "\n" not in r.reason
        assert r.status == "runs" or r.reason, f"{r.model_type} is {r.status} without a reason"


def test_the_number_that_runs_never_falls(fast):
    runs = sum(r.status == "runs" for r in fast)
    assert runs >= RUNS_FLOOR, f"{runs} architectures run, the floor is {RUNS_FLOOR}:\n{report(fast)}"


def test_the_readme_lists_what_the_sweep_found(fast):
    """README's model table holds the sweep's block as the sweep prints it (``--markdown``): every architecture
    that runs, every one refused and why, every one not built tiny and why."""
    block = markdown(fast)
    assert block in README.read_text(), f"README's sweep block is out of date; the sweep prints:\n{block}"


@pytest.mark.sweep_full
@pytest.mark.parametrize("model_type", causal_lm_types())
def test_full_sweep_every_method_sampled_and_batched(model_type):
    """One architecture in the full form (CI: ``pytest -n 2 --dist load -m sweep_full``, spread over workers)."""
    result = run_architecture(model_type, full=True)
    assert result.status != "failed", result.reason
    assert "\n" not in result.reason


@pytest.mark.parametrize(("model_type", "norm"), [("gpt2", "ln_f"), ("opt", "project_out"), ("phi", "final")])
def test_hidden_states_come_from_what_the_output_layer_reads(tmp_path, model_type, norm):
    """Families whose final norm is not called ``norm`` (and OPT, whose ``lm_head`` reads a projection after it) run
    MTP's hidden-state capture: the rows equal what the model's own ``lm_head`` reads."""
    from lattice_inference.targets.transformers import TransformersTarget, hidden_state_source

    path = save_tiny_model(model_type, tmp_path / model_type)
    gen = Generator.from_pretrained(str(path), device="cpu", method="greedy")
    target = gen.decoder.target
    assert isinstance(target, TransformersTarget)
    source, why = hidden_state_source(gen.model)
    assert source is not None, why
    assert norm in next(n for n, m in gen.model.named_modules() if m is source)
    assert target.provides_hidden_states
    ids = gen.encode("the cat sat on the mat, the cat sat")
    seq = target.new_sequence(capture_hidden=True)
    target.prefill(seq, ids)
    read: list[torch.Tensor] = []
    hook = gen.model.get_output_embeddings().register_forward_pre_hook(lambda m, args: read.append(args[0]))
    try:
        with torch.inference_mode():
            gen.model(input_ids=torch.tensor([ids]), logits_to_keep=0)
    finally:
        hook.remove()
    assert seq.hidden is not None
    torch.testing.assert_close(seq.hidden, read[0][0], rtol=1e-5, atol=1e-5)
    target.release(seq)


def test_a_model_without_readable_hidden_states_runs_lookup_and_refuses_mtp_at_start(tmp_path):
    """A model that transforms its hidden states on the way to ``lm_head`` gives none to MTP heads: greedy and
    ``ngram`` still run (equal), the MTP method is refused when the generator is built, in one line."""
    from lattice_inference.api import mtp_head_for
    from lattice_inference.models.load import load_model

    loaded = load_model("bundled", dtype="float32", device="cpu")
    loaded.model.lm_head.register_forward_pre_hook(lambda module, args: (args[0] * 1.5,))
    head = mtp_head_for(loaded, 2)
    with pytest.raises(ConfigError) as refused:
        Generator(loaded.model, loaded.tokenizer, method="mtp", mtp_head=head)
    message = str(refused.value)
    assert "\n" not in message and "hidden states" in message and "output layer" in message
    prompt = "abc abc abc abc"
    greedy = Generator(loaded.model, loaded.tokenizer, method="greedy").generate(prompt, 16).token_ids
    ngram = Generator(loaded.model, loaded.tokenizer, method="ngram").generate(prompt, 16).token_ids
    assert ngram == greedy


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "lattice_inference.cli", "generate", *args, "--max-new-tokens", "8"]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_the_cli_runs_a_family_outside_llama_and_refuses_an_encoder_in_one_line(tmp_path):
    gpt2 = save_tiny_model("gpt2", tmp_path / "gpt2")
    proc = _cli("--model", str(gpt2), "--prompt", "hello hello hello", "--method", "ngram")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    bert = save_tiny_model("bert", tmp_path / "bert")
    proc = _cli("--model", str(bert), "--prompt", "hello")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    error = proc.stderr.strip()
    assert "\n" not in error and "attends to later tokens" in error
