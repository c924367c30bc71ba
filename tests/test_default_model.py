"""The bundled default model: transformers loads its trunk, the project loads its MTP head, and every method
emits greedy's tokens on its own evaluation prompts."""

from __future__ import annotations

import json

import pytest
import torch

from lattice_inference import Generator
from lattice_inference.models.source import BUNDLED_DIR
from lattice_inference.mtp import load_mtp_head

MODEL_DIR = BUNDLED_DIR


@pytest.fixture(scope="module")
def greedy():
    return Generator.from_pretrained(str(MODEL_DIR), method="greedy", dtype="float32")


def eval_prompts(kind: str, n: int) -> list[str]:
    rows = [json.loads(line) for line in (MODEL_DIR / "eval_prompts.jsonl").read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows if r.get("kind") == kind][:n]


def test_files_and_size():
    assert (MODEL_DIR / "config.json").is_file() and (MODEL_DIR / "tokenizer.json").is_file()
    size = sum(f.stat().st_size for f in MODEL_DIR.glob("*.safetensors"))
    assert size <= 40 * 1024 * 1024
    assert eval_prompts("copy", 1) and eval_prompts("free", 1)


def test_trunk_is_hybrid_and_head_loads(greedy):
    assert greedy.model.config.model_type == "qwen3_5_text"
    head = load_mtp_head(MODEL_DIR, dtype=torch.float32)
    assert head.config.vocab_size == greedy.model.config.vocab_size


@pytest.mark.parametrize("method", ["ngram", "mtp", "ngram+mtp"])
def test_methods_equal_greedy_on_eval_prompts(greedy, method):
    fast = Generator(
        greedy.model,
        greedy.tokenizer,
        method=method,
        draft_length=3,
        adaptive=False,  # every proposal verified, so that acceptance is certain to be exercised
        mtp_head=load_mtp_head(MODEL_DIR, dtype=torch.float32, draft_length=3) if "mtp" in method else None,
    )
    accepted = 0
    for prompt in eval_prompts("copy", 2) + eval_prompts("free", 2):
        want = greedy.generate(prompt, max_new_tokens=48)
        got = fast.generate(prompt, max_new_tokens=48)
        assert got.token_ids == want.token_ids
        accepted += got.metrics.accepted_tokens
    assert accepted > 0


def test_trained_head_beats_chance_on_held_out_text(greedy):
    """The shipped MTP head learned something: its draft of token t+2 matches greedy's output well above chance.
    Fixed drafts: every round drafts, so the share measures the head, not which rounds the planner found paying."""
    head = load_mtp_head(MODEL_DIR, dtype=torch.float32, draft_length=2)
    mtp = Generator(greedy.model, greedy.tokenizer, method="mtp", draft_length=2, mtp_head=head, adaptive=False)
    drafted = accepted = 0
    for prompt in eval_prompts("free", 3):
        m = mtp.generate(prompt, max_new_tokens=48).metrics
        drafted += m.drafted_tokens
        accepted += m.accepted_tokens
    assert drafted > 0 and accepted / drafted > 0.4, (accepted, drafted)
