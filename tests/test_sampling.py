"""Keyed sampling: processors equal transformers', exact distributions (plain and speculative), seeds, and
option validation (API and CLI)."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace

import pytest
import torch

from lattice_inference import Generator, SamplingOptions
from lattice_inference.cli import main
from lattice_inference.decode import SpeculativeDecoder
from lattice_inference.errors import ConfigError
from lattice_inference.sampling import GreedySampler, KeyedSampler, gumbel_noise, process_logits
from lattice_inference.targets.base import Target
from lattice_testing.toy import save_toy_model_dir

from .helpers import OracleDrafter, hf_warpers

PROCESSOR_SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.3),
    dict(temperature=1.7, top_k=5),
    dict(temperature=0.8, top_k=500),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.5, top_p=1e-6),
    dict(temperature=1.2, min_p=0.1),
    dict(temperature=1.0, min_p=1.0),
    dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05),
]


@pytest.mark.parametrize("settings", PROCESSOR_SETTINGS)
def test_processors_equal_transformers(settings):
    options = SamplingOptions(**settings)
    gen = torch.Generator().manual_seed(len(str(settings)))
    logits = torch.randn(6, 300, generator=gen) * 3
    logits[0, :10] = logits[0, 0]  # ties
    expected = logits.clone()
    for warper in hf_warpers(options):
        expected = warper(None, expected)
    assert torch.equal(process_logits(logits, options), expected)


def _chi_square_ok(counts: Counter, probs: torch.Tensor, n: int) -> None:
    """Counts follow ``probs``: no draw outside the support, chi-square under df + 8 sqrt(2 df) (a p-value far
    below 1e-6 for these df; the seeds are fixed, so the test is deterministic)."""
    support = {i for i, p in enumerate(probs.tolist()) if p > 0}
    assert set(counts) <= support, set(counts) - support
    stat = sum((counts.get(i, 0) - n * probs[i].item()) ** 2 / (n * probs[i].item()) for i in support)
    df = len(support) - 1
    assert stat < df + 8 * math.sqrt(2 * df), (stat, df)
    tv = 0.5 * sum(abs(counts.get(i, 0) / n - probs[i].item()) for i in support)
    assert tv < 2 * math.sqrt(len(support) / n), tv


LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.5, 0.2, 0.0, -0.3, -0.8, -1.5, -2.0, 3.0])
DIST_SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_k=4), dict(temperature=1.3, top_p=0.8, min_p=0.02)]


@pytest.mark.parametrize("settings", DIST_SETTINGS)
def test_keyed_sampler_draws_the_processed_softmax(settings):
    n = 3000
    counts = Counter(
        KeyedSampler(SamplingOptions(**settings, seed=s), len(LOGITS)).choose(LOGITS[None], 17)[0] for s in range(n)
    )
    _chi_square_ok(counts, process_logits(LOGITS, SamplingOptions(**settings)).softmax(-1), n)


class FixedLogitsTarget(Target):
    """Every position has the same logits: each sampled token is an independent draw from one distribution."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    vocab_size = property(lambda self: self.logits.shape[0])
    max_positions = property(lambda self: None)

    def prefill(self, seq, token_ids):
        seq.length = len(token_ids)
        return self.logits.clone()

    def forward(self, seq, token_ids):
        seq.length += len(token_ids)
        return self.logits.expand(len(token_ids), -1).clone()

    def rollback(self, seq, length):
        seq.length = length


def test_speculative_path_draws_the_processed_softmax():
    """Tokens sampled inside verification rows (accepted, corrected or bonus) follow the processed softmax."""
    options = SamplingOptions(temperature=0.9, top_p=0.9)
    probs = process_logits(LOGITS, options).softmax(-1)
    target = FixedLogitsTarget(LOGITS)
    reference = [11, 0, 1, 11, 0, 2] * 3  # drafts of likely tokens: full, partial and rejected rounds
    n = 2000
    by_index: list[Counter] = [Counter(), Counter(), Counter()]
    for s in range(n):
        drafter = OracleDrafter(reference, vocab=len(LOGITS), corrupt=0.2, seed=s)
        out = SpeculativeDecoder(target, drafter, max_draft=3, adaptive=False).generate(
            [0, 1], 3, replace(options, seed=s)
        )
        for i, t in enumerate(out.token_ids):
            by_index[i][t] += 1
    for counts in by_index:
        _chi_square_ok(counts, probs, n)


def test_noise_is_a_function_of_seed_and_index():
    a = gumbel_noise(5, 100, 64)
    assert torch.equal(a, gumbel_noise(5, 100, 64))
    assert not torch.equal(a, gumbel_noise(5, 101, 64))
    assert not torch.equal(a, gumbel_noise(6, 100, 64))
    assert not torch.equal(gumbel_noise(1, 0, 64), gumbel_noise(1 + 2**32, 0, 64))  # a 64-bit key, not 32
    sampler = KeyedSampler(SamplingOptions(temperature=1.0, seed=5), 64)
    rows = torch.randn(3, 64)
    # Row i chooses index first_index + i, whatever was asked before.
    assert sampler.choose(rows, 100) == [
        KeyedSampler(sampler.options, 64).choose(rows[i : i + 1], 100 + i)[0] for i in range(3)
    ]
    assert GreedySampler().choose(rows, 0) == rows.argmax(-1).tolist()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("seed", 1.5),
        ("seed", "7"),
    ],
)
def test_bad_sampling_options(field, value):
    with pytest.raises(ConfigError, match=field) as exc:
        SamplingOptions(**{field: value})
    assert repr(value) in str(exc.value)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_toy_model_dir(tmp_path_factory.mktemp("toy") / "model", "llama", init_std=0.3, seed=3))


PROMPT = "the cat sat on the mat. the cat sat on the"


def test_seeds_api(model_dir):
    gen = Generator.from_pretrained(model_dir, dtype="float32", method="ngram")
    plain = Generator(gen.model, gen.tokenizer, method="greedy")
    outs = [gen.generate(PROMPT, 24, temperature=1.0, seed=s).token_ids for s in range(4)]
    assert len({tuple(o) for o in outs}) > 1, "different seeds should give different text"
    assert gen.generate(PROMPT, 24, temperature=1.0, seed=2).token_ids == outs[2]
    assert plain.generate(PROMPT, 24, temperature=1.0, seed=2).token_ids == outs[2]
    drawn = gen.generate(PROMPT, 24, temperature=1.0, top_k=40)
    assert isinstance(drawn.seed, int)
    assert plain.generate(PROMPT, 24, temperature=1.0, top_k=40, seed=drawn.seed).token_ids == drawn.token_ids
    assert gen.generate(PROMPT, 24).seed is None  # greedy
    text = "".join(gen.stream(PROMPT, 24, temperature=1.0, seed=2))
    assert text == gen.tokenizer.decode(outs[2], skip_special_tokens=True)
    with pytest.raises(ConfigError, match="top_p"):
        gen.generate(PROMPT, 4, temperature=1.0, top_p=2.0)


def _interleaved(gens) -> None:
    """Iterate the generations ``gens`` one chunk each in turn until all are done."""
    running = list(gens)
    while running:
        for gen in list(running):
            if next(gen, None) is None:
                running.remove(gen)


def test_generations_interleave(model_dir):
    """Per-generation state: an abandoned stream cannot corrupt the next generation, and two generations of one
    decoder iterated in turn each give exactly what they give alone."""
    gen = Generator.from_pretrained(model_dir, dtype="float32", method="ngram")
    want = gen.generate(PROMPT, 16, temperature=0.8, seed=9)
    alone = gen.generate(PROMPT, 16, temperature=0.8, seed=1)
    other = gen.generate("hello world, hello world", 16, temperature=0.8, seed=9)
    first = gen.start(PROMPT, 16, temperature=0.8, seed=1)
    next(first)
    again = gen.generate(PROMPT, 16, temperature=0.8, seed=9)
    assert again.token_ids == want.token_ids and again.metrics.new_tokens == want.metrics.new_tokens
    assert first.result().token_ids == alone.token_ids  # it continues after another generation ran to the end
    a = gen.start(PROMPT, 16, temperature=0.8, seed=1)
    b = gen.start("hello world, hello world", 16, temperature=0.8, seed=9)
    _interleaved([a, b])
    assert a.token_ids == alone.token_ids and a.stop_reason == alone.stop_reason
    assert b.token_ids == other.token_ids and b.stop_reason == other.stop_reason


def run_json(capsys, *args: str) -> dict:
    assert main(["generate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_seed_reported_and_reproducible(model_dir, capsys):
    common = ["--model", model_dir, "--prompt", PROMPT, "--max-new-tokens", "20", "--dtype", "float32"]
    drawn = run_json(capsys, *common, "--temperature", "0.9", "--top-p", "0.95")
    assert isinstance(drawn["seed"], int) and drawn["sampling"]["temperature"] == 0.9
    again = run_json(
        capsys, *common, "--temperature", "0.9", "--top-p", "0.95", "--seed", str(drawn["seed"]), "--method", "greedy"
    )
    assert again["token_ids"] == drawn["token_ids"]
    assert run_json(capsys, *common)["seed"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--temperature", "hot"], "--temperature must be a number, got 'hot'"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--min-p", "2"], "min_p must be in [0, 1]"),
        (["--top-k", "-3"], "top_k must be an integer >= 0"),
        (["--seed", "1.5"], "--seed must be an integer, got '1.5'"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_cli_bad_sampling_one_line(model_dir, capsys, args, message, command):
    extra = ["--prompt", PROMPT] if command == "generate" else []
    assert main([command, "--model", model_dir, *extra, *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().startswith("lattice: error:") and message in captured.err
    assert len(captured.err.strip().splitlines()) == 1 and not captured.out


def test_bench_at_a_temperature(model_dir, tmp_path, capsys):
    """``lattice bench --temperature``: every method compared with plain sampling under the same seeds."""
    prompts = tmp_path / "p.jsonl"
    rows = [{"kind": "copy", "prompt": PROMPT}, {"kind": "free", "prompt": "hello world"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["bench", "--model", model_dir, "--prompts", str(prompts), "--methods", "ngram", "--max-new-tokens", "16"]
    argv += ["--dtype", "float32", "--temperature", "0.9", "--top-k", "50"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sampling"]["temperature"] == 0.9 and isinstance(report["sampling"]["seed"], int)
    assert all(r["identical_share"] == 1.0 for r in report["rows"])
    assert main([*argv, "--seed", "5"]) == 0
    assert "with seed 5 + i" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_first_max_is_torch_argmax_with_ties_to_the_lowest_index(dtype):
    """`first_max` (numpy's argmax on the CPU) chooses what ``torch.argmax`` chooses, row by row: ties (many, in
    bfloat16's coarse grid) to the lowest index, rows of minus infinity, a strided view."""
    from lattice_inference.sampling import first_max

    noise = torch.Generator().manual_seed(0)
    rows = (torch.randn(64, 4096, generator=noise) * 4).round().to(dtype)  # coarse values: ties in every row
    rows[3] = float("-inf")
    rows[5, 7] = rows[5, 4000] = rows[5].max() + 1  # a tie at the maximum, far apart
    for scores in (rows, rows[:, ::2], rows[10:11]):
        assert first_max(scores) == scores.argmax(dim=-1).tolist()
    assert first_max(rows)[5] == 7
