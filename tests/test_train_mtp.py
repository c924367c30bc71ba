"""``lattice train-mtp`` and stand-alone MTP heads on attention models (tiny random Llama / Qwen3, float32).

A trained head round-trips through its files; ``mtp`` and ``ngram+mtp`` with a loaded head emit exactly the
``greedy`` method's tokens (greedy and seeded sampling); a 20-step run lowers the held-out loss and writes a head
that loads; a head that does not fit a model is refused with the field named.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lattice_inference import Generator
from lattice_inference.api import mtp_head_for
from lattice_inference.cli import main
from lattice_inference.errors import ModelLoadError
from lattice_inference.models.load import LoadedModel, load_model
from lattice_inference.mtp.head_file import config_for_target, load_head_file
from lattice_inference.train.export import HEAD_NAME, export_head
from lattice_inference.train.model import TrainableHead
from lattice_testing.toy import save_toy_model_dir, toy_config, toy_model

from .helpers import FLAT_COSTS

TEXT = "The quick brown fox jumps over the lazy dog. " * 8 + "def add(a, b):\n    return a + b\n" * 6


@pytest.fixture(scope="module")
def toy_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("toys")
    return {arch: save_toy_model_dir(root / arch, arch, init_std=0.02, seed=3) for arch in ("llama", "qwen3")}


@pytest.fixture(scope="module")
def trained(toy_dirs, tmp_path_factory) -> Path:
    """A 20-step training run on the tiny Llama; returns its output folder."""
    root = tmp_path_factory.mktemp("run")
    data = root / "data.txt"
    data.write_text(TEXT * 4)
    out = root / "out"
    argv = ["train-mtp", "--model", str(toy_dirs["llama"]), "--data", str(data), "--out", str(out)]
    argv += ["--steps", "20", "--tokens", "4000", "--seq-len", "48", "--batch", "4", "--lr", "3e-3", "--threads", "1"]
    assert main(argv) == 0
    return out


def test_training_lowers_loss_and_writes_a_head_that_loads(trained, toy_dirs):
    history = json.loads((trained / "training_log.json").read_text())["history"]
    assert history[0]["step"] == 0 and history[-1]["step"] == 20
    assert history[-1]["heldout_loss"] < history[0]["heldout_loss"]
    # both drafts right is a subset of the first right (47 chains per 48-row window)
    assert all(0.0 <= h["acceptance_2"] <= h["acceptance"] * 48 / 47 for h in history)
    loaded = load_model(str(toy_dirs["llama"]), dtype="float32")
    head = mtp_head_for(loaded, 3, head_path=trained)
    assert head.config.hidden_size == 64 and head.config.num_drafts == 2


def test_resume_continues_and_refuses_to_overwrite(trained, toy_dirs, capsys):
    data = trained.parent / "data.txt"
    argv = ["train-mtp", "--model", str(toy_dirs["llama"]), "--data", str(data), "--out", str(trained)]
    argv += ["--tokens", "4000", "--seq-len", "48", "--batch", "4", "--threads", "1"]
    assert main([*argv, "--steps", "22"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main([*argv, "--steps", "22", "--resume"]) == 0
    assert json.loads((trained / "training_log.json").read_text())["steps"] == 22


def test_training_can_start_from_a_saved_head(trained, toy_dirs, tmp_path, capsys):
    """``--init-head`` starts from the saved head's weights (its first probe is where the trained head ended, not
    where a fresh start begins), and a head for another model or a model without a packaged head is refused by name."""
    data = trained.parent / "data.txt"
    base = ["train-mtp", "--data", str(data), "--tokens", "4000", "--seq-len", "48", "--batch", "4", "--threads", "1"]
    out = tmp_path / "tuned"
    argv = [*base, "--model", str(toy_dirs["llama"]), "--out", str(out), "--init-head", str(trained)]
    assert main([*argv, "--steps", "1", "--lr", "1e-12"]) == 0
    history = json.loads((trained / "training_log.json").read_text())["history"]
    start = json.loads((out / "training_log.json").read_text())["history"][0]
    assert start["step"] == 0 and history[-1]["heldout_loss"] < history[0]["heldout_loss"] - 0.1
    assert start["heldout_loss"] == pytest.approx(history[-1]["heldout_loss"], abs=0.03)  # bf16 head file
    saved = load_file(str(trained / HEAD_NAME))
    tuned = load_file(str(out / HEAD_NAME))
    assert saved.keys() == tuned.keys()
    for name, tensor in saved.items():
        torch.testing.assert_close(tuned[name], tensor, rtol=0, atol=1e-2)
    capsys.readouterr()
    other = [*base, "--model", str(toy_dirs["qwen3"]), "--out", str(tmp_path / "q"), "--init-head", str(trained)]
    assert main(other) == 2
    assert "model_type" in capsys.readouterr().err
    none = [*base, "--model", str(toy_dirs["llama"]), "--out", str(tmp_path / "s"), "--init-head", "shipped"]
    assert main(none) == 2
    assert "no head ships" in capsys.readouterr().err


def _random_head(model, seed: int = 0) -> TrainableHead:
    torch.manual_seed(seed)
    return TrainableHead(config_for_target(model.config), std=0.1)


def _saved_and_loaded(arch: str, toy_dirs, folder: Path, seed: int):
    """A random trainable head for the toy ``arch``, written in float32 and loaded back as a drafting head:
    ``(trainable, drafting, meta, embed)``."""
    lm = load_model(str(toy_dirs[arch]), dtype="float32").model
    train_head = _random_head(lm, seed)
    export_head(train_head, lm.config, folder, draft_vocab=None, training={}, dtype=torch.float32)
    embed, lm_head = lm.get_input_embeddings().weight, lm.get_output_embeddings().weight
    head, meta = load_head_file(folder / HEAD_NAME, lm.config, embed, lm_head)
    return train_head, head, meta, embed


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_saved_head_round_trips(arch, toy_dirs, tmp_path):
    train_head, head, meta, embed = _saved_and_loaded(arch, toy_dirs, tmp_path, seed=0)
    hidden = torch.randn(1, 7, 64)
    tokens = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        want = train_head(hidden, tokens, embed)[0]
    _, got = head.forward_many(tokens[0], range(7), hidden[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert meta["target"]["model_type"] == arch


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chained_training_steps_are_the_drafting_heads_chain(arch, toy_dirs, tmp_path):
    """`forward_chain` step ``j`` at origin ``t`` equals the loaded head drafting ``j`` steps from ``h_t``: the
    cache holds rows from target hiddens up to ``t``, then the head's own hiddens at ``t+1..``."""
    train_head, head, _, embed = _saved_and_loaded(arch, toy_dirs, tmp_path, seed=2)
    hidden = torch.randn(1, 8, 64)
    tokens = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        chain = train_head.forward_chain(hidden, tokens, embed, 3)
    assert [tuple(o.shape) for o in chain] == [(1, 8, 64), (1, 7, 64), (1, 6, 64)]
    for t in range(6):
        head.reset_cache()
        if t:
            head.prefill(hidden[0, :t], tokens[0, :t], 0)
        hid = hidden[0, t]
        for j in range(3):
            _, hid = head.forward_one(int(tokens[0, t + j]), t + j, hid)
            torch.testing.assert_close(hid, chain[j][0, t], rtol=1e-5, atol=1e-5)
    # step 2 differs from step 1 on the same rows: the chain really feeds the head's own hiddens
    assert not torch.allclose(chain[1][0], train_head(hidden, tokens, embed)[0, 1:], atol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("method", ["mtp", "ngram+mtp"])
def test_loaded_head_is_lossless(arch, method, toy_dirs, tmp_path):
    loaded = load_model(str(toy_dirs[arch]), dtype="float32")
    lm, tok = loaded.model, loaded.tokenizer
    export_head(_random_head(lm, seed=1), lm.config, tmp_path, draft_vocab=200, training={})
    head = mtp_head_for(loaded, 3, head_path=tmp_path)
    greedy = Generator(lm, tok, method="greedy")
    spec = Generator(lm, tok, method=method, draft_length=3, mtp_head=head, costs=FLAT_COSTS)
    for prompt in ("hello hello hello", "def f(x): return x + 1\ndef g"):
        assert spec.generate(prompt, 40).token_ids == greedy.generate(prompt, 40).token_ids
        sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 11}
        got = spec.generate(prompt, 40, **sampled)
        assert got.token_ids == greedy.generate(prompt, 40, **sampled).token_ids
    assert got.metrics.drafted_tokens > 0


def test_generator_from_pretrained_takes_a_head_path(trained, toy_dirs):
    gen = Generator.from_pretrained(str(toy_dirs["llama"]), dtype="float32", method="mtp", mtp_head=str(trained))
    ref = Generator.from_pretrained(str(toy_dirs["llama"]), dtype="float32", method="greedy")
    assert gen.generate(TEXT[:60], 30).token_ids == ref.generate(TEXT[:60], 30).token_ids


def test_cli_generate_with_mtp_head(trained, toy_dirs, capsys):
    argv = ["generate", "--model", str(toy_dirs["llama"]), "--mtp-head", str(trained), "--method", "mtp"]
    assert main([*argv, "--prompt", "hello", "--no-chat", "--max-new-tokens", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "mtp"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"hidden_size": 48, "head_dim": 12}, "hidden_size"),
        ({"vocab_size": 300}, "vocab_size"),
        ({"num_hidden_layers": 3}, "num_hidden_layers"),
    ],
)
def test_a_head_that_does_not_fit_names_the_field(overrides, field, trained):
    other = LoadedModel(toy_model(toy_config("llama", **overrides)), None, (), "other")  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError, match=field):
        mtp_head_for(other, 3, head_path=trained)


def test_model_type_mismatch_names_the_field(trained, toy_dirs):
    with pytest.raises(ModelLoadError, match="model_type"):
        mtp_head_for(load_model(str(toy_dirs["qwen3"]), dtype="float32"), 3, head_path=trained)


def test_missing_head_and_bad_data_are_clear(toy_dirs, tmp_path, capsys):
    loaded = load_model(str(toy_dirs["llama"]), dtype="float32")
    with pytest.raises(ModelLoadError, match="does not exist"):
        mtp_head_for(loaded, 3, head_path=tmp_path / "none.safetensors")
    argv = ["train-mtp", "--model", str(toy_dirs["llama"]), "--data", str(tmp_path / "nope"), "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "no such file" in capsys.readouterr().err


def test_interrupt_stops_cleanly_with_a_usable_checkpoint(toy_dirs, tmp_path):
    """SIGINT mid-run: the loop finishes its step, writes the checkpoint and exports the head, then returns."""
    import os
    import signal

    from lattice_inference.train.data import ShardCache, trunk_rows
    from lattice_inference.train.loop import LoopConfig, train

    loaded = load_model(str(toy_dirs["llama"]), dtype="float32")
    lm = loaded.model
    ids = loaded.tokenizer(TEXT * 2).input_ids
    windows = [ids[i : i + 33] for i in range(0, len(ids) - 33, 33)]

    class InterruptingCache(ShardCache):
        calls = 0

        def sample(self, rng, batch):
            self.calls += 1
            if self.calls == 3:
                os.kill(os.getpid(), signal.SIGINT)
            return super().sample(rng, batch)

    cache = InterruptingCache(tmp_path / "shards", windows, 2, lm)
    held = trunk_rows(lm, torch.tensor(windows[:2]))
    head = _random_head(lm)
    exported = []
    state = train(
        head,
        cache,
        held,
        lm.get_input_embeddings().weight,
        lm.get_output_embeddings().weight,
        LoopConfig(steps=500, batch=2),
        checkpoint=tmp_path / "checkpoint.pt",
        resume=False,
        on_checkpoint=lambda s: exported.append(export_head(head, lm.config, tmp_path, draft_vocab=None, training={})),
        log=lambda _msg: None,
    )
    assert state.step == 3
    assert (tmp_path / "checkpoint.pt").is_file() and exported
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["state"]["step"] == 3
    mtp_head_for(loaded, 2, head_path=tmp_path)


def test_soft_loss_is_the_kl_to_the_targets_next_distribution(toy_dirs):
    """With ``soft_weight=1`` the loss is KL(target || head): zero for a 'head' that returns the target's own next
    hidden (its logits are the target's), positive for one that lags a position."""
    from lattice_inference.train.data import trunk_rows
    from lattice_inference.train.loop import head_loss

    loaded = load_model(str(toy_dirs["llama"]), dtype="float32")
    lm = loaded.model
    rows = trunk_rows(lm, torch.tensor([loaded.tokenizer(TEXT).input_ids[:40]]))
    rows["hidden"] = rows["hidden"].float()
    embed, lm_head = lm.get_input_embeddings().weight, lm.get_output_embeddings().weight
    vocab = int(lm_head.shape[0])

    class Fixed:  # a stand-in head whose first draft step returns a given function of the target hiddens
        def __init__(self, fn):
            self.fn = fn

        def forward_chain(self, hidden, tokens, embed, depth):
            return [self.fn(hidden)]

    leading = Fixed(lambda hidden: torch.cat([hidden[:, 1:], hidden[:, -1:]], dim=1))
    lagging = Fixed(lambda hidden: hidden)

    with torch.no_grad():
        (exact,), _, _ = head_loss(leading, rows, embed, lm_head, vocab, soft_weight=1.0)
        (off,), _, _ = head_loss(lagging, rows, embed, lm_head, vocab, soft_weight=1.0)
        (hard,), _, _ = head_loss(lagging, rows, embed, lm_head, vocab, soft_weight=0.0)
        (mixed,), _, _ = head_loss(lagging, rows, embed, lm_head, vocab, soft_weight=0.25)
    assert abs(float(exact)) < 1e-5
    assert float(off) > 0.01
    assert float(mixed) == pytest.approx(0.75 * float(hard) + 0.25 * float(off), rel=1e-5)


def test_soft_weight_out_of_range_is_refused(toy_dirs, tmp_path, capsys):
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    argv = ["train-mtp", "--model", str(toy_dirs["llama"]), "--data", str(data), "--out", str(tmp_path / "o")]
    assert main([*argv, "--soft-weight", "1.5"]) == 2
    assert "--soft-weight must lie in [0, 1], got 1.5" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_builtin_prompts_are_distinct_stable_and_kept_apart_from_the_benchmarks():
    from lattice_inference.train.prompts import benchmark_texts, builtin_prompts

    short, long = builtin_prompts(300, seed=1), builtin_prompts(2000, seed=1)
    assert long[:300] == short  # a self-distillation cache stays valid when --num-prompts grows
    users = [conv[-1]["content"] for conv in long]
    assert len(set(users)) == len(long) == 2000
    assert not set(users) & benchmark_texts()
    assert all(conv[-1]["role"] == "user" and conv[0]["role"] in ("system", "user") for conv in long)
    composed = long[1000:]
    assert any(conv[0]["role"] == "system" for conv in composed)
    assert len({u.split()[0] for u in users[1000:]}) >= 8  # many kinds of request, not one template
    assert builtin_prompts(2000, seed=2) != long


def test_shards_of_other_windows_are_refused(toy_dirs, tmp_path):
    from lattice_inference.errors import ConfigError
    from lattice_inference.train.data import ShardCache

    lm = load_model(str(toy_dirs["llama"]), dtype="float32").model
    windows = [[i % 50 + 3] * 9 for i in range(6)]
    ShardCache(tmp_path, windows, 2, lm).ensure(0)
    assert ShardCache(tmp_path, windows, 2, lm).ready() == [0]  # the same windows resume
    with pytest.raises(ConfigError, match=r"other training windows .*6 windows.*this run has 5"):
        ShardCache(tmp_path, windows[:5], 2, lm)
    with pytest.raises(ConfigError, match="data or its settings changed"):
        ShardCache(tmp_path, windows[::-1], 2, lm)
