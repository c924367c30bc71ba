"""A prefill keeps the cached rows of its prompt's longest prefix the previous sequence left (``prefix_cache``),
and only where they are bit for bit what it would compute: the logits and every later token equal a fresh
target's, on the Llama, Qwen2 and Qwen3 toys and the real model; nothing is kept across settings that compute rows
differently (thread count), for hidden-state capture, past the native prefill's length, or across tenants in
``lattice serve``."""

from __future__ import annotations

import random

import pytest
import torch

from lattice_inference import Generator
from lattice_inference.models.load import LoadedModel
from lattice_inference.options import DecodeOptions
from lattice_inference.targets import LeanTarget
from lattice_inference.targets import lean as lean_module
from lattice_inference.targets.prefix_reuse import CachedRows, KeptSequences
from lattice_testing.toy import byte_tokenizer, toy_config, toy_model

from .serve_harness import request, running_server

LEAN_ARCHES = ["llama", "qwen2", "qwen3"]
SHAPES = dict(hidden_size=128, intermediate_size=1536, head_dim=32)


def _model(arch: str, dtype: torch.dtype, seed: int = 1):
    return toy_model(toy_config(arch, **SHAPES), init_std=0.3, seed=seed).to(dtype)


def _reuses(target: LeanTarget) -> bool:
    """Whether ``target`` computes a fresh prefill as it computes every later row (where not, as with oneDNN's
    products, it must reuse nothing)."""
    return target._row_key("") is not None


def test_cached_rows_follow_feeds_rollbacks_and_kept_paths():
    rows = CachedRows()
    assert rows.reusable([1, 2, 3], ("k",)) == 0  # nothing cached
    rows = CachedRows(key=("k",))
    rows.fed([1, 2, 3, 4])
    rows.fed([5, 6, 7])  # a tree's rows as fed
    rows.keep(4, [0, 2])
    assert rows.tokens == [1, 2, 3, 4, 5, 7]
    rows.rollback(5)
    assert rows.tokens == [1, 2, 3, 4, 5]
    assert rows.reusable([1, 2, 3, 9], ("k",)) == 3
    assert rows.reusable([1, 2, 3, 4, 5], ("k",)) == 4  # the last prompt row is always fed
    assert rows.reusable([1, 2, 3, 4, 5, 6], ("k",)) == 5
    assert rows.reusable([1, 2, 3, 4, 5, 6], ("other",)) == 0
    rows.key = None
    assert rows.reusable([1, 2], ("k",)) == 0


def test_kept_sequences_give_the_longest_prefix_least_recently_used_dropped_first():
    def rows(tokens: list[int], owner: str = "") -> CachedRows:
        kept = CachedRows(key=("k", owner))
        kept.fed(tokens)
        return kept

    kept: KeptSequences[str] = KeptSequences(7)
    kept.keep(rows([1, 2, 3, 4]), "a")
    kept.keep(rows([1, 2, 9]), "b")
    kept.keep(CachedRows(), "never")  # not reusable: not kept
    kept.keep(rows(list(range(8))), "too long")  # over the whole budget alone
    assert len(kept) == 2 and kept.tokens == 7
    assert kept.best([1, 2, 3, 4, 5], ("k", "")) == (0, 4)
    assert kept.best([1, 2, 9, 9], ("k", "")) == (1, 3)
    assert kept.best([1, 2, 3, 4, 5], ("k", "bob")) == (-1, 0)  # another owner's rows
    kept.keep(rows([7, 8], "bob"), "c")  # 9 rows: "a", used least recently, is dropped
    assert len(kept) == 2 and kept.best([1, 2, 3, 4, 5], ("k", ""))[1] == 2
    assert kept.take(1)[1] == "c" and len(kept) == 1
    kept.keep(rows([7, 8], "bob"), "c")
    kept.forget("bob")
    assert len(kept) == 1 and kept.best([1, 2, 9, 9], ("k", ""))[1] == 3
    kept.forget()
    assert len(kept) == 0


@pytest.mark.parametrize(("dtype", "kv_cache"), [(torch.bfloat16, "model"), (torch.float32, "model"),
                                                 (torch.float32, "float16")])  # fmt: skip
@pytest.mark.parametrize("arch", LEAN_ARCHES)
def test_a_reused_prefix_gives_a_fresh_prefills_logits_and_steps(arch, dtype, kv_cache):
    """Rows cached by a prefill, 1-token steps, a chain, a draft tree's kept path and a rollback, then reused by the
    next prompt: its logits and the steps after it equal a fresh target's bit for bit (float16 caches too)."""
    model = _model(arch, dtype)
    lean = LeanTarget(model, prefix_budget=0, kv_cache=kv_cache)  # the live cache
    fresh = LeanTarget(model, prefix_cache=False, kv_cache=kv_cache)
    rng = random.Random(arch)
    context = [rng.randrange(256) for _ in range(70)]
    seq, fresh_seq = lean.new_sequence(), fresh.new_sequence()  # each prefill reuses what this sequence's last left
    lean.prefill(seq, context)
    lean.forward(seq, [5])
    lean.forward(seq, [6, 7, 8, 9])
    start = seq.length
    lean.forward_tree(seq, [1, 2, 3, 4, 5], [-1, 0, 1, 0, 3])
    lean.keep_rows(seq, start, [0, 3, 4])
    lean.rollback(seq, seq.length - 1)
    cached = [*context, 5, 6, 7, 8, 9, 1, 4]  # the ids of the rows left
    assert seq.length == len(cached)
    for prompt in ([*cached, 11, 12, 13], [*context[:40], 3, 3], cached, [*context[:1], 2]):
        logits = lean.prefill(seq, prompt)
        expected = 0
        if _reuses(lean):
            expected = next((i for i, (a, b) in enumerate(zip(cached, prompt, strict=False)) if a != b), None)
            expected = min(len(cached) if expected is None else expected, len(prompt) - 1)
        assert seq.reused == expected, prompt
        assert torch.equal(logits, fresh.prefill(fresh_seq, prompt)), prompt
        assert fresh_seq.reused == 0
        for tokens in ([7], [8, 9, 10]):
            assert torch.equal(lean.forward(seq, tokens), fresh.forward(fresh_seq, tokens))
        cached = [*prompt, 7, 8, 9, 10]
    if dtype == torch.bfloat16 and lean_module.native_ops.rows() is not None:
        assert _reuses(lean)  # where our products run (tiles, else rows from bfloat16 bytes), rows are reusable
    if dtype == torch.float32 and lean_module.native_ops.rows() is not None:
        assert _reuses(lean)  # where the row products run, float32 rows are reusable


def test_nothing_is_reused_under_other_settings():
    model = _model("llama", torch.bfloat16)
    lean = LeanTarget(model, prefix_budget=0)  # the live cache only: what each prefill leaves there
    if not _reuses(lean):
        pytest.skip("this CPU computes bfloat16 prefills with row-count-dependent products: nothing is reused")
    prompt = list(range(40, 100))
    seq = lean.new_sequence()
    lean.prefill(seq, prompt)
    lean.prefill(seq, prompt)
    assert seq.reused == len(prompt) - 1
    captured = lean.new_sequence(capture_hidden=True)  # an MTP head reads every prompt row's hidden state
    for _ in range(2):  # not even its own rows
        lean.prefill(captured, prompt)
        assert captured.reused == 0 and captured.hidden is not None and captured.hidden.shape[0] == len(prompt)
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        lean.prefill(seq, prompt)
        assert seq.reused == 0
    finally:
        torch.set_num_threads(threads)
    lean.prefill(seq, prompt)
    assert seq.reused == 0  # rows of the other thread count
    lean.prefill(seq, prompt)
    assert seq.reused == len(prompt) - 1
    lean.forget_prefix()
    lean.prefill(seq, prompt)
    assert seq.reused == 0
    kept = LeanTarget(model)  # a released sequence's rows, kept: a capturing prefill does not take them either
    first = kept.new_sequence()
    kept.prefill(first, prompt)
    kept.release(first)
    captured = kept.new_sequence(capture_hidden=True)
    kept.prefill(captured, prompt)
    assert captured.reused == 0 and captured.hidden is not None and captured.hidden.shape[0] == len(prompt)
    plain = kept.new_sequence()
    kept.prefill(plain, prompt)
    assert plain.reused == len(prompt) - 1  # they were there to take


@pytest.mark.parametrize("method", ["greedy", "ngram", "suffix"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_conversation_on_one_generator_equals_fresh_generators(method, temperature):
    """Turns whose prompts hold the earlier turns and answers: one generator reusing its cache emits, token for
    token, what a generator without the prefix cache emits (greedy and seeded sampling)."""
    model = _model("qwen3", torch.bfloat16, seed=3)
    tokenizer = byte_tokenizer()
    options = dict(method=method, temperature=temperature, seed=7, eos_token_ids=[])
    reusing = Generator(model, tokenizer, **options)
    rng = random.Random(method)
    sequence = [rng.randrange(256) for _ in range(50)]
    cached = 0
    for turn in range(4):
        sequence += [rng.randrange(256) for _ in range(6)] + sequence[10:20]
        fresh = Generator(model, tokenizer, prefix_cache=False, **options)
        out = reusing.generate(sequence, max_new_tokens=24)
        assert out.token_ids == fresh.generate(sequence, max_new_tokens=24).token_ids, turn
        cached += out.metrics.cached_prompt_tokens
        sequence += out.token_ids
    if _reuses(reusing.decoder.target):
        assert cached > 0


def test_alternating_sequences_find_their_own_kept_rows():
    """Two conversations and a shared system prompt, taking turns on one target: each turn reuses its own
    conversation's rows from the kept caches (not only the live one's), and equals a fresh prefill bit for bit."""
    model = _model("llama", torch.bfloat16, seed=2)
    lean, fresh = LeanTarget(model, prefix_budget=1000), LeanTarget(model, prefix_cache=False)
    if not _reuses(lean):
        pytest.skip("this CPU computes bfloat16 prefills with row-count-dependent products: nothing is reused")
    rng = random.Random(2)
    system = [rng.randrange(256) for _ in range(30)]
    talks = {name: [*system, *(rng.randrange(256) for _ in range(20))] for name in "ab"}
    cached = {"a": 0, "b": len(system)}  # b's first turn: the system prompt of a's
    seq = None
    for turn in range(3):
        for name, talk in talks.items():
            if seq is not None:
                lean.release(seq)  # the turn before ended: its rows are kept
            seq, fresh_seq = lean.new_sequence(), fresh.new_sequence()
            logits = lean.prefill(seq, talk)
            assert seq.reused == cached[name], (turn, name)
            assert torch.equal(logits, fresh.prefill(fresh_seq, talk))
            answer = [rng.randrange(256) for _ in range(3)]
            for token in answer:
                assert torch.equal(lean.forward(seq, [token]), fresh.forward(fresh_seq, [token]))
            assert seq.length == len(talk) + len(answer) == len(seq.rows.tokens)
            cached[name] = seq.length
            fresh.release(fresh_seq)
            talk += [*answer, *(rng.randrange(256) for _ in range(4))]
    assert len(lean._kept) == 1  # the other conversation; the live sequence holds this one
    lean.release(seq)
    assert len(lean._kept) == 2
    shared = lean.new_sequence()
    lean.prefill(shared, [*system, 1])  # the shared prompt: copied out, its sources stay whole
    assert shared.reused == len(system) and len(lean._kept) == 2
    assert max(len(rows.tokens) for rows, _ in lean._kept._kept) > len(system) + 20


def _toy_loaded() -> LoadedModel:
    return LoadedModel(_model("llama", torch.bfloat16, seed=5), byte_tokenizer(), (), "toy")


def test_the_server_reuses_a_prefix_within_a_tenant_only():
    loaded = _toy_loaded()
    probe = LeanTarget(loaded.model)
    if not probe._row_key(""):
        pytest.skip("this CPU computes bfloat16 prefills with row-count-dependent products: nothing is reused")

    def cached(base: str, key: str, prompt: str) -> tuple[str, int]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "speculative": {"method": "ngram"}}
        answer = request(base, "POST", "/v1/completions", body, headers={"authorization": f"Bearer {key}"})
        assert answer.status_code == 200, answer.text
        out = answer.json()
        return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]

    prompt = "def add(a, b):\n    return a + b\n" * 3
    with running_server(loaded, method="ngram", api_key=["alice", "bob"]) as (base, _):
        text, none = cached(base, "alice", prompt)
        assert none == 0
        assert cached(base, "alice", prompt) == (text, len(prompt) - 1)  # byte tokens: one per character
        assert cached(base, "bob", prompt) == (text, 0)  # alice's rows are not bob's
        assert cached(base, "bob", prompt + "x")[1] == len(prompt)
        assert cached(base, "alice", prompt)[1] == len(prompt) - 1  # hers, kept while bob's ran
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "speculative": {"clear_index": True}}
        cleared = request(base, "POST", "/v1/completions", body, headers={"authorization": "Bearer alice"})
        assert cleared.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        scraped = request(base, "GET", "/metrics", headers={"authorization": "Bearer alice"}).text
        assert f"lattice_cached_prompt_tokens_total {float(3 * len(prompt) - 2)}" in scraped
    with running_server(loaded, method="ngram") as (base, _):  # no keys: the server's one user
        assert cached(base, "none", prompt)[1] == 0
        assert cached(base, "none", prompt) == (text, len(prompt) - 1)
    with running_server(loaded, method="ngram", suffix_scope="request") as (base, _):  # isolation asked for
        assert cached(base, "none", prompt)[1] == cached(base, "none", prompt)[1] == 0
    assert DecodeOptions().prefix_cache


def test_the_budget_follows_memory_and_drops_everything_when_memory_runs_low(monkeypatch):
    """By default the budget is half the memory available at start, in tokens of the model's keys and values (an
    explicit budget is kept as given); a keep that finds the machine low on memory drops every kept sequence."""
    from lattice_inference.targets import memory

    model = _model("llama", torch.float32)
    lean = LeanTarget(model)
    config = model.config
    heads = config.num_key_value_heads
    per_token = config.num_hidden_layers * 2 * heads * (config.hidden_size // config.num_attention_heads) * 4
    assert lean.prefix_memory.token_bytes == per_token
    found = memory.memory_bytes(lean.device)
    assert found is not None and 0 < found[0] <= found[1]  # /proc/meminfo on Linux
    assert lean.prefix_memory.tokens == pytest.approx(memory.MEMORY_SHARE * found[0] / per_token, rel=0.2)
    assert lean._kept.budget == lean.prefix_memory.tokens and "tokens kept" in lean.prefix_memory.line()
    assert LeanTarget(model, prefix_budget=123).prefix_memory.tokens == 123
    monkeypatch.setattr(memory, "memory_bytes", lambda device: (3 * 2**30, 16 * 2**30))
    assert memory.auto_budget(1024, torch.device("cpu"), 8192).tokens == 3 * 2**30 // 2 // 1024
    assert not memory.low_memory(torch.device("cpu"))
    monkeypatch.setattr(memory, "memory_bytes", lambda device: None)  # unknown: the fallback
    assert memory.auto_budget(1024, torch.device("cpu"), 8192).tokens == 8192
    low = [False]
    kept: KeptSequences[str] = KeptSequences(100, low_memory=lambda: low[0])
    for name in "ab":
        kept.keep(CachedRows([1, 2, 3], ("k",)), name)
    assert len(kept) == 2
    low[0] = True
    kept.keep(CachedRows([4, 5], ("k",)), "c")
    assert len(kept) == 0 and kept.tokens == 0


@pytest.mark.parametrize(("dtype", "kv_cache"), [(torch.float32, "model"), (torch.bfloat16, "model"),
                                                 (torch.float32, "float16")])  # fmt: skip
def test_turns_either_side_of_the_old_4096_token_switch_reuse_and_equal_recomputing(dtype, kv_cache):
    """A conversation whose turns grow from below 4096 tokens (where prefills once switched to flash attention,
    whose rows were not reusable) to above it: every turn reuses the one before, and its logits and steps equal a
    fresh target's that computes every row."""
    model = toy_model(toy_config("qwen2", hidden_size=64, intermediate_size=128, head_dim=16), init_std=0.3, seed=4)
    model = model.to(dtype)
    lean = LeanTarget(model, kv_cache=kv_cache)
    fresh = LeanTarget(model, prefix_cache=False, kv_cache=kv_cache)
    if not _reuses(lean):
        pytest.skip("this CPU computes these prefills with row-count-dependent products: nothing is reused")
    rng = random.Random(7)
    talk = [rng.randrange(256) for _ in range(4000)]
    before = 0
    for turn in range(3):
        seq, fresh_seq = lean.new_sequence(), fresh.new_sequence()
        logits = lean.prefill(seq, talk)
        assert seq.reused == before, turn
        assert torch.equal(logits, fresh.prefill(fresh_seq, talk)), turn
        answer = [rng.randrange(256) for _ in range(3)]
        for token in answer:
            assert torch.equal(lean.forward(seq, [token]), fresh.forward(fresh_seq, [token])), turn
        before = seq.length
        lean.release(seq)
        fresh.release(fresh_seq)
        talk += [*answer, *(rng.randrange(256) for _ in range(60))]
    assert len(talk) > 4096 + 60
