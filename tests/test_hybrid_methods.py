"""`--method mtp` end to end on tiny hybrid Qwen3.5 models with an MTP head written into their checkpoint.

Two heads: a random one (std 0.3: drafts mostly rejected) and an "echo" head built so that it predicts the token
it is fed (fc keeps only the embedding half, attention and MLP outputs are zero, the embedding is tied), which on
a looping model drafts the pending token again and again: full, partial and immediately rejected drafts. Output
must equal ``model.generate(do_sample=False)`` token for token in every case.
"""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

from lattice_inference import Generator
from lattice_inference.cli import main
from lattice_inference.drafters.mtp import BACK_OFF, MtpDrafter, confidence_key
from lattice_inference.errors import ConfigError
from lattice_inference.mtp import MtpConfig, load_mtp_head
from lattice_testing.mtp_checkpoint import random_mtp_tensors
from lattice_testing.toy import byte_tokenizer


def tiny_config(vocab: int, moe: bool = False) -> Qwen3_5TextConfig:
    config_class = Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig
    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    return config_class(
        **(extra if moe else {}),
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"],
        tie_word_embeddings=True,
        mtp_num_hidden_layers=1,
        max_position_embeddings=1024,
        eos_token_id=256,
        bos_token_id=256,
        pad_token_id=256,
    )


def write_model(path, *, init_std: float, head: str, seed: int = 0, moe: bool = False):
    """Save a tiny Qwen3.5 (or Qwen3.5-MoE) text model plus ``mtp.*`` tensors (``random`` or ``echo``) and the
    byte tokenizer."""
    tok = byte_tokenizer()
    cfg = tiny_config(len(tok), moe)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and p.dim() > 1:
                p.normal_(0.0, init_std)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    mcfg = MtpConfig.from_hf_config(path)
    mtp = {
        k: v for k, v in random_mtp_tensors(mcfg, cfg.model_type, std=0.3, seed=seed).items() if k.startswith("mtp.")
    }
    if head == "echo":
        h = cfg.hidden_size
        for k in mtp:
            if "norm" in k or "o_proj" in k or "down_proj" in k:
                mtp[k].zero_()
        mtp["mtp.fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    weights = load_file(str(path / "model.safetensors"))
    weights.update(mtp)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {
        "echo-looping": write_model(root / "echo", init_std=0.02, head="echo"),
        "random-diverse": write_model(root / "rand", init_std=0.3, head="random", seed=1),
        "moe-echo": write_model(root / "moe", init_std=0.05, head="echo", seed=2, moe=True),
    }


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        span = [rng.randrange(256) for _ in range(rng.randint(2, 12))]
        out.append(span * rng.randint(1, 3) + [rng.randrange(256) for _ in range(rng.randint(0, 6))])
    return out


@pytest.fixture(scope="module")
def greedy_runs(models):
    """Per model: the greedy generator and, per prompt, transformers' plain greedy output (checked equal)."""
    runs = {}
    for kind, path in models.items():
        greedy = Generator.from_pretrained(str(path), method="greedy", dtype="float32")
        expected = []
        for prompt in prompts(6, seed=len(kind)):
            ids = torch.tensor([prompt])
            hf = greedy.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW,
                do_sample=False,
                eos_token_id=256,
                pad_token_id=256,
            )[0, len(prompt) :].tolist()
            hf = hf[: hf.index(256)] if 256 in hf else hf
            assert greedy.generate(prompt, max_new_tokens=NEW).token_ids == hf
            expected.append((prompt, hf))
        runs[kind] = (greedy, expected)
    return runs


NEW = 24


@pytest.mark.parametrize("adaptive", [False, True])
def test_ngram_equals_greedy_on_hybrids(greedy_runs, adaptive):
    """Prompt lookup on hybrid dense and MoE models: exact recurrent-state rollback keeps it lossless (with every
    proposal verified, the draft shapes are checked too; the planner's choices depend on measured costs)."""
    drafted = accepted = 0
    for greedy, expected in greedy_runs.values():
        ngram = Generator(greedy.model, greedy.tokenizer, method="ngram", min_ngram=1, max_draft=5, adaptive=adaptive)
        for prompt, want in expected:
            got = ngram.generate(prompt, max_new_tokens=NEW)
            assert got.token_ids == want, prompt
            drafted += got.metrics.drafted_tokens
            accepted += got.metrics.accepted_tokens
    if not adaptive:
        assert 0 < accepted < drafted


@pytest.mark.parametrize(("draft_length", "adaptive"), [(2, False), (4, False), (4, True)])
def test_mtp_equals_greedy(models, greedy_runs, draft_length, adaptive):
    shapes = {"full": 0, "partial": 0, "rejected": 0}
    for kind, (greedy, expected) in greedy_runs.items():
        mtp = Generator(
            greedy.model,
            greedy.tokenizer,
            method="mtp",
            draft_length=draft_length,
            adaptive=adaptive,
            mtp_head=load_mtp_head(models[kind], dtype=torch.float32, draft_length=draft_length),
        )
        for prompt, want in expected:
            got = mtp.generate(prompt, max_new_tokens=NEW)
            assert got.token_ids == want, (kind, prompt)
            if adaptive:  # lossless whatever the planner chose; the shapes below need every proposal verified
                continue
            m = got.metrics
            assert m.drafts > 0 and m.drafter_forwards >= m.drafted_tokens
            per = m.accepted_per_position + [0] * draft_length
            shapes["full"] += per[draft_length - 2]
            shapes["rejected"] += m.drafts - per[0]
            shapes["partial"] += per[0] - per[draft_length - 2]
    if adaptive:
        return
    assert shapes["full"] > 0 and shapes["rejected"] > 0, shapes
    if draft_length > 2:
        assert shapes["partial"] > 0, shapes


def test_cli_mtp_json(models, capsys):
    path = str(models["echo-looping"])
    args = ["generate", "--model", path, "--prompt", "abcabcabc", "--max-new-tokens", "24", "--json", "--no-chat"]
    assert main([*args, "--method", "greedy", "--dtype", "float32"]) == 0
    greedy = capsys.readouterr().out
    assert main([*args, "--method", "mtp", "--draft-length", "3", "--dtype", "float32", "--fixed-draft"]) == 0
    import json

    g, m = json.loads(greedy), json.loads(capsys.readouterr().out)
    assert m["token_ids"] == g["token_ids"]
    ref = m["mtp_metrics"]
    assert ref["draft_tokens"] == m["metrics"]["drafted_tokens"] + m["metrics"]["drafts"]
    assert ref["accepted_tokens_per_forward"] == pytest.approx(m["metrics"]["mean_acceptance_length"])


def test_cli_mtp_errors(models, tmp_path, capsys):
    path = str(models["echo-looping"])
    assert main(["generate", "--model", path, "--prompt", "x", "--method", "mtp", "--draft-length", "9"]) == 2
    assert "must be 2..8, got 9" in capsys.readouterr().err
    plain = tmp_path / "plain"
    from lattice_testing.toy import save_toy_model_dir

    save_toy_model_dir(plain, "qwen3")
    assert main(["generate", "--model", str(plain), "--prompt", "x", "--method", "mtp"]) == 2
    err = capsys.readouterr().err
    assert "lattice: error:" in err and "Traceback" not in err


def test_draft_vocab_restricts_drafts_and_keeps_the_output(models, capsys):
    """--draft-vocab N drafts only ids < N; drafts outside it are never proposed, the output stays greedy's."""
    import json

    path = str(models["echo-looping"])
    args = ["generate", "--model", path, "--prompt", "abcabcabc", "--max-new-tokens", "24", "--json", "--no-chat"]
    assert main([*args, "--method", "greedy", "--dtype", "float32"]) == 0
    greedy = json.loads(capsys.readouterr().out)
    assert min(greedy["token_ids"]) > 0
    full = Generator.from_pretrained(path, dtype="float32", method="mtp", draft_length=3, adaptive=False)
    low = min(greedy["token_ids"])  # every drafted id would be >= low: none fits below it
    tiny = Generator.from_pretrained(
        path, dtype="float32", method="mtp", draft_length=3, draft_vocab=low, adaptive=False
    )
    ids = full.encode("abcabcabc")
    a, b = full.generate(ids, 24), tiny.generate(ids, 24)
    assert a.token_ids == b.token_ids == greedy["token_ids"]
    assert a.metrics.accepted_tokens > 0  # the echo head's drafts are accepted over the whole vocabulary ...
    assert b.metrics.drafted_tokens > 0 and b.metrics.accepted_tokens == 0  # ... and none from ids < low

    assert main([*args, "--method", "mtp", "--draft-length", "3", "--dtype", "float32", "--draft-vocab", "64"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == greedy["token_ids"]
    with pytest.raises(SystemExit) as exc:
        main([*args, "--method", "mtp", "--draft-vocab", "0"])
    assert exc.value.code == 2
    assert "must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="draft_vocab must be a positive number"):
        Generator.from_pretrained(path, method="mtp", draft_vocab=-3)


def test_ngram_plus_mtp_equals_greedy_and_uses_both_drafters(models, greedy_runs):
    """ngram+mtp: lookup where an n-gram matches, the MTP head elsewhere; both draft, the output is greedy's."""
    from lattice_inference.drafters.fallback import FallbackDrafter, FallbackState

    used = [0, 0]
    for kind, (greedy, expected) in greedy_runs.items():
        both = Generator(
            greedy.model,
            greedy.tokenizer,
            method="ngram+mtp",
            min_ngram=2,
            max_draft=4,
            draft_length=3,
            adaptive=False,
            mtp_head=load_mtp_head(models[kind], dtype=torch.float32, draft_length=3),
        )
        drafter = both.decoder.drafter
        assert isinstance(drafter, FallbackDrafter) and drafter.uses_hidden_states
        for prompt, want in expected:
            gen = both.start(prompt, max_new_tokens=NEW)
            got = gen.result()
            state = gen.drafter_state
            assert isinstance(state, FallbackState)
            assert got.token_ids == want, (kind, prompt)
            assert sum(state.proposals_by) == got.metrics.drafts
            used = [u + n for u, n in zip(used, state.proposals_by, strict=True)]
            assert got.metrics.drafter_forwards == state.states[1].forward_count
    assert used[0] > 0 and used[1] > 0, used
    with pytest.raises(ConfigError, match="'ngram\\+mtp' needs an MTP head"):
        Generator(greedy.model, greedy.tokenizer, method="ngram+mtp")


class ScriptedPlan:
    """A `Plan` that answers every `choose` with ``answer`` and records the calls."""

    def __init__(self, answer: int, pays: bool = True) -> None:
        self.answer, self.pays, self.calls, self.timed, self.asked = answer, pays, [], 0, 0

    def choose(self, available: int, key: int = 0, *, free: bool = True, drafted: int = 0) -> int:
        self.calls.append((available, key, free, drafted))
        return self.answer

    def choose_tree(self, available: int, key: int = 0, *, drafted: int = 0, runners_up: int = 0) -> tuple[int, list]:
        return self.choose(available, key, free=False, drafted=drafted), [0] * self.answer

    def drafting_pays(self, available: int, key_group: int = 0, *, runners_up: int = 0) -> bool:
        self.asked += 1
        return self.pays

    def observe_drafter_seconds(self, seconds_per_token: float) -> None:
        assert seconds_per_token > 0
        self.timed += 1


def test_planned_mtp_rounds_are_keyed_by_the_first_drafts_confidence(models):
    """Under the planner the head drafts one token, the round's key is that draft's confidence band, and the
    chain goes on only as far as the plan says; drafts equal the head's own `forward_one` chain."""
    path = models["random-diverse"]
    drafter = MtpDrafter(load_mtp_head(path, dtype=torch.float32, draft_length=3))
    ref = load_mtp_head(path, dtype=torch.float32, draft_length=3)
    rows, forward = [], drafter.head._forward
    drafter.head._forward = lambda ids, *a, **k: rows.append(len(ids)) or forward(ids, *a, **k)
    torch.manual_seed(0)
    hidden, prompt = torch.randn(12, 64), [3, 5, 7, 11, 13, 17, 19, 23, 29, 31]
    state = drafter.start(prompt)
    state.observe(hidden[:10], 0)
    state.extend([37])
    declined = state.propose_planned(2, plan := ScriptedPlan(0))
    ref.prefill(hidden[:9], prompt[1:], 0)
    logits, own = ref.forward_one(37, 9, hidden[9])
    first, confidence = int(torch.argmax(logits)), float(torch.softmax(logits, 0).max())
    assert declined.proposal == [first] and declined.verify == [] and declined.key == confidence_key(confidence)
    assert plan.calls == [(2, declined.key, False, 1)] and state.forward_count == 1

    state.extend([41])
    state.observe(hidden[10:11], 10)
    wanted = state.propose_planned(2, ScriptedPlan(2))
    logits, own = ref.forward_one(41, 10, hidden[10])
    second = int(torch.argmax(logits))
    third = int(torch.argmax(ref.forward_one(second, 11, own)[0]))
    assert wanted.proposal == wanted.verify == [second, third]
    assert rows == [10, 1, 1]  # a stopped chain still commits its catch-up: nothing is recomputed
    assert wanted.key == confidence_key(float(torch.softmax(logits, 0).max()))
    assert [confidence_key(c) for c in (0.1, 0.4, 0.65, 0.85, 0.95)] == [1, 2, 3, 4, 5]


def test_planned_mtp_backs_off_while_every_round_is_declined(models):
    """After `BACK_OFF` declined rounds in a row the head drafts only every `BACK_OFF`-th round (a probe), and
    drafts every round again once a probe is wanted."""
    path = models["random-diverse"]
    drafter = MtpDrafter(load_mtp_head(path, dtype=torch.float32, draft_length=3))
    torch.manual_seed(1)
    state = drafter.start([1, 2, 3])
    state.observe(torch.randn(3, 64), 0)

    length = 3

    def rounds(n: int, answer: int) -> list[bool]:  # plain rounds: one token accepted, its hidden observed
        nonlocal length
        drafted = []
        for _ in range(n):
            state.extend([4])
            planned = state.propose_planned(2, ScriptedPlan(answer))
            drafted.append(bool(planned.proposal))
            state.observe(torch.randn(1, 64), length)
            length += 1
        return drafted

    assert rounds(BACK_OFF, 0) == [True] * BACK_OFF
    assert rounds(2 * BACK_OFF, 0) == ([True] + [False] * (BACK_OFF - 1)) * 2
    assert rounds(1, 0) == [True]  # the next probe, declined again
    assert rounds(BACK_OFF + 3, 1) == [False] * (BACK_OFF - 1) + [True] * 4


def test_planned_mtp_drafts_only_probes_while_drafting_does_not_pay(models):
    """While the planner expects the head's rounds not to pay for their own cost, the head drafts every
    `BACK_OFF`-th round only (asking again after each probe); a probe catches the head's cache up over the plain
    rounds (its drafts still equal the head's own chain over every position) and its time, mostly that catch-up,
    is not reported as a draft's cost."""
    path = models["random-diverse"]
    drafter = MtpDrafter(load_mtp_head(path, dtype=torch.float32, draft_length=3))
    ref = load_mtp_head(path, dtype=torch.float32, draft_length=3)
    torch.manual_seed(2)
    hidden, tokens = torch.randn(40, 64), [int(t) for t in torch.randint(0, 50, (41,))]
    state = drafter.start(tokens[:3])
    state.observe(hidden[:3], 0)
    plan, drafted = ScriptedPlan(0, pays=False), []
    for position in range(3, 3 + 2 * BACK_OFF):
        state.extend([tokens[position]])
        planned = state.propose_planned(2, plan)
        drafted.append(planned.proposal)
        state.observe(hidden[position : position + 1], position)
    probes = [i for i, proposal in enumerate(drafted) if proposal]
    assert probes == [BACK_OFF - 1, 2 * BACK_OFF - 1] and plan.timed == 0 and state.forward_count == 2
    assert plan.asked == 2  # once at the start and once after the first probe
    probe = 2 + BACK_OFF  # the position of the first probe's pending token
    ref.prefill(hidden[: probe - 1], tokens[1:probe], 0)
    logits, _ = ref.forward_one(tokens[probe], probe - 1, hidden[probe - 1])
    assert drafted[BACK_OFF - 1] == [int(torch.argmax(logits))]
    plan.pays = True
    state.extend([tokens[3 + 2 * BACK_OFF]])
    assert state.propose_planned(2, plan).proposal  # paying again: a draft every round
    state.observe(hidden[3 + 2 * BACK_OFF : 4 + 2 * BACK_OFF], 3 + 2 * BACK_OFF)
    state.extend([tokens[4 + 2 * BACK_OFF]])
    assert state.propose_planned(2, plan).proposal and plan.timed == 2
    assert plan.asked == 3  # after the second probe; while drafting pays, every `ASK_EVERY`-th round only
