"""Tests of `HybridTarget`: exact rollback of attention KV, conv and Gated DeltaNet recurrent state.

The models are tiny (hidden 64, 4 layers: 3 Gated DeltaNet + 1 full attention, vocab 260) but every non-norm
weight is drawn with std 0.25, so that a wrong recurrent state visibly changes the logits and the argmax (with the
default 0.02 init the error of a missed rollback is ~1e-3 and silent). All comparisons are float32.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    PreTrainedModel,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
)
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from lattice_inference.decode import SpeculativeDecoder
from lattice_inference.drafters.base import Drafter, DrafterState, Proposal
from lattice_inference.errors import ConfigError, TokenError, UnsupportedModelError
from lattice_inference.targets import gdn_dispatch, hybrid
from lattice_inference.targets.base import TargetSequence
from lattice_inference.targets.hybrid import HybridTarget, is_hybrid, recurrent_gated_delta_rule_with_states
from lattice_inference.targets.kv_cache import record_past

VOCAB = 260
INIT_STD = 0.25
LOGIT_ATOL = 5e-4
"""Logits here reach |6|; k-token and one-token forwards differ by <= ~1e-4 (GEMM blocking differs with M)."""
STATE_ATOL = 1e-4
"""Conv states hold in_proj outputs (|x| ~ 0.2) computed by GEMMs of different row counts (prefill vs verify), so
they round differently by the CPU's kernels: 5.1e-5 seen on an AVX2-only machine, under 5e-5 with AVX-512."""

ARCHES = ("qwen3_5", "qwen3_next", "qwen3_5_moe")


def hybrid_config(arch: str) -> object:
    """A tiny config of ``arch`` with layer types [linear, linear, linear, full]."""
    common: dict[str, object] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    moe: dict[str, object] = dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
    )
    if arch == "qwen3_5":
        return Qwen3_5TextConfig(**common, intermediate_size=128)
    if arch == "qwen3_next":
        return Qwen3NextConfig(**common, intermediate_size=128, **moe)
    if arch == "qwen3_5_moe":
        return Qwen3_5MoeTextConfig(**common, **moe)
    raise ValueError(arch)


def build_model(arch: str, seed: int = 0) -> PreTrainedModel:
    """A random float32 model of ``arch`` with every non-norm weight ~ N(0, INIT_STD)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hybrid_config(arch), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, INIT_STD)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def models() -> dict[str, PreTrainedModel]:
    torch.set_num_threads(1)
    return {arch: build_model(arch, seed=i) for i, arch in enumerate(ARCHES)}


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def linear_layers(cache: DynamicCache) -> list[int]:
    return [i for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]


def assert_same_cache(got: DynamicCache, want: DynamicCache, atol: float) -> None:
    """Conv states, recurrent states and attention KV of two caches agree (same shapes, values within atol)."""
    assert len(got.layers) == len(want.layers)
    for i, (g, w) in enumerate(zip(got.layers, want.layers, strict=True)):
        if isinstance(w, LinearAttentionCacheLayerMixin):
            torch.testing.assert_close(g.conv_states[0], w.conv_states[0], atol=atol, rtol=0, msg=f"conv {i}")
            torch.testing.assert_close(
                g.recurrent_states[0], w.recurrent_states[0], atol=atol, rtol=0, msg=f"recurrent {i}"
            )
        else:
            torch.testing.assert_close(g.keys, w.keys, atol=atol, rtol=0, msg=f"keys {i}")
            torch.testing.assert_close(g.values, w.values, atol=atol, rtol=0, msg=f"values {i}")


# ---------------------------------------------------------------------------------------------------------------
# The problem this target solves


@pytest.mark.parametrize("arch", ARCHES)
def test_transformers_crop_cannot_roll_back_the_recurrent_state_and_ours_does(
    models: dict[str, PreTrainedModel], arch: str
) -> None:
    """transformers' own rollback (record past, forward k tokens, crop) is wrong for GDN layers (5.24) or refuses
    (5.25, unless told to keep states); ours is exact."""
    model = models[arch]
    rng = random.Random(1)
    prompt, draft, nxt = random_ids(rng, 10), random_ids(rng, 4), rng.randrange(VOCAB)
    accepted = 1

    def run(cache: DynamicCache, ids: Sequence[int], start: int) -> torch.Tensor:
        pos = torch.arange(start, start + len(ids)).unsqueeze(0)
        with torch.inference_mode():
            return model(input_ids=torch.tensor([list(ids)]), position_ids=pos, cache=cache, use_cache=True).logits[0]

    fresh = DynamicCache(config=model.config)
    fresh_logits = run(fresh, [*prompt, *draft[:accepted], nxt], 0)[-1]

    cache = record_past(DynamicCache(config=model.config))
    run(cache, prompt, 0)
    cache.crop(0)
    run(cache, draft, len(prompt))
    try:
        cache.crop(accepted - len(draft))
    except IndexError:  # transformers >= 5.25 keeps no state history unless asked to (and then runs token by token)
        pass
    else:  # transformers 5.24 crops the conv state only
        hf_logits = run(cache, [nxt], len(prompt) + accepted)[-1]
        hf_error = (hf_logits - fresh_logits).abs().max().item()
        assert hf_error > 0.5, f"transformers' crop happened to be right (error {hf_error}); the test shows nothing"

    target = HybridTarget(model)
    seq = target.new_sequence()
    target.prefill(seq, prompt)
    target.forward(seq, draft)
    target.rollback(seq, len(prompt) + accepted)
    ours = target.forward(seq, [nxt])[-1]
    torch.testing.assert_close(ours, fresh_logits, atol=LOGIT_ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# The recording kernel


def test_recording_kernel_is_transformers_recurrent_kernel_op_for_op() -> None:
    """Output and final state are bitwise those of transformers' kernel; states[i] = state after i tokens."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule as reference

    torch.manual_seed(0)
    b, t, hk, hv, d = 1, 6, 2, 4, 16
    q, k = torch.randn(b, t, hk, d), torch.randn(b, t, hk, d)
    v = torch.randn(b, t, hv, d)
    g, beta = -torch.rand(b, t, hv), torch.rand(b, t, hv)
    s0 = torch.randn(b, hv, d, d)
    out, final, states = recurrent_gated_delta_rule_with_states(q, k, v, g, beta, s0, use_qk_l2norm_in_kernel=True)
    ref_out, ref_final = reference(
        q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert torch.equal(out, ref_out) and torch.equal(final, ref_final)
    assert len(states) == t + 1 and torch.equal(states[0], s0) and states[0] is not s0
    state = s0
    for i in range(t):  # one-token calls, as plain decoding makes them
        sl = slice(i, i + 1)
        _, state = reference(
            q[:, sl], k[:, sl], v[:, sl], g=g[:, sl], beta=beta[:, sl], initial_state=state,
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        assert torch.equal(states[i + 1], state)


@pytest.mark.parametrize("heads", [(2, 4), (4, 4)])
def test_window_kernel_equals_the_token_by_token_recurrence(heads: tuple[int, int]) -> None:
    """Output, final state and the rebuilt state after every position match transformers' one-token steps."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule as reference

    hk, hv = heads
    for t, decay_scale in ((2, 1.0), (7, 1.0), (16, 1.0), (5, 80.0)):  # 80: decays underflow to exactly 0
        torch.manual_seed(t)
        q, k = torch.randn(1, t, hk, 16), torch.randn(1, t, hk, 16)
        v = torch.randn(1, t, hv, 16)
        g, beta = -torch.rand(1, t, hv) * decay_scale, torch.rand(1, t, hv)
        s0 = torch.randn(1, hv, 16, 16)
        out, final, factors = hybrid.gated_delta_rule_window(q, k, v, g, beta, s0, use_qk_l2norm_in_kernel=True)
        state, outs = s0, []
        assert torch.equal(factors.state_at(0), s0)
        for i in range(t):
            sl = slice(i, i + 1)
            o, state = reference(
                q[:, sl], k[:, sl], v[:, sl], g=g[:, sl], beta=beta[:, sl], initial_state=state,
                output_final_state=True, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            outs.append(o)
            torch.testing.assert_close(factors.state_at(i + 1), state, atol=2e-6, rtol=0)
        torch.testing.assert_close(out, torch.cat(outs, dim=1), atol=2e-6, rtol=0)
        torch.testing.assert_close(final, state, atol=2e-6, rtol=0)


def test_kernels_are_restored_after_forward(models: dict[str, PreTrainedModel]) -> None:
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    before = [getattr(modeling, name) for name in gdn_dispatch.KERNEL_NAMES]
    target = HybridTarget(models["qwen3_5"])
    seq = target.new_sequence()
    target.prefill(seq, [1, 2, 3])
    target.forward(seq, [4, 5, 6])
    assert [getattr(modeling, name) for name in gdn_dispatch.KERNEL_NAMES] == before


def test_failed_forward_restores_kernels_and_requires_prefill(
    models: dict[str, PreTrainedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers.models.qwen3_next.modeling_qwen3_next as modeling

    before = [getattr(modeling, name) for name in gdn_dispatch.KERNEL_NAMES]

    def broken(*args: object, **kwargs: object) -> None:
        raise ArithmeticError("boom")

    monkeypatch.setattr(hybrid, "recurrent_gated_delta_rule_with_states", broken)
    monkeypatch.setattr(hybrid, "gated_delta_rule_window", broken)
    target = HybridTarget(models["qwen3_next"])
    seq = target.new_sequence()
    target.prefill(seq, [1, 2, 3])
    with pytest.raises(ArithmeticError):
        target.forward(seq, [4, 5])
    assert [getattr(modeling, name) for name in gdn_dispatch.KERNEL_NAMES] == before
    with pytest.raises(RuntimeError):
        target.forward(seq, [4])
    monkeypatch.undo()
    target.prefill(seq, [1, 2, 3])
    assert target.forward(seq, [4, 5]).shape == (2, VOCAB)


# ---------------------------------------------------------------------------------------------------------------
# Rollback exactness


def fresh_target(model: PreTrainedModel, ids: Sequence[int]) -> tuple[HybridTarget, TargetSequence, torch.Tensor]:
    """A new target, a sequence prefilled with ``ids`` on it, and the prefill's logits."""
    target = HybridTarget(model)
    seq = target.new_sequence()
    return target, seq, target.prefill(seq, ids)


@pytest.mark.parametrize("kernel", hybrid.KERNELS)
@pytest.mark.parametrize("arch", ARCHES)
def test_rollback_state_and_logits_equal_a_fresh_run(
    models: dict[str, PreTrainedModel], arch: str, kernel: str
) -> None:
    """For random k and accepted a: cache state and next logits after rollback equal a fresh run's."""
    model = models[arch]
    rng = random.Random(ARCHES.index(arch))
    for _ in range(6):
        prompt = random_ids(rng, rng.randrange(1, 14))
        k = rng.randrange(1, 9)
        a = rng.randrange(0, k + 1)
        draft, nxt = random_ids(rng, k), rng.randrange(VOCAB)
        target = HybridTarget(model, kernel=kernel)
        seq = target.new_sequence()
        target.prefill(seq, prompt)
        logits = target.forward(seq, draft)
        assert logits.shape == (k, VOCAB)
        target.rollback(seq, len(prompt) + a)
        assert seq.length == len(prompt) + a

        accepted = [*prompt, *draft[:a]]
        fresh, fresh_seq, _ = fresh_target(model, accepted)
        assert seq.cache is not None and fresh_seq.cache is not None
        assert seq.cache.get_seq_length() == len(accepted)
        assert_same_cache(seq.cache, fresh_seq.cache, STATE_ATOL)
        ours = target.forward(seq, [nxt])
        theirs = fresh.forward(fresh_seq, [nxt])
        torch.testing.assert_close(ours, theirs, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("kernel", hybrid.KERNELS)
@pytest.mark.parametrize("arch", ARCHES)
def test_k_token_forward_equals_k_one_token_forwards(
    models: dict[str, PreTrainedModel], arch: str, kernel: str
) -> None:
    """The recording path over k tokens gives the logits of k plain decode steps (float32 tolerance)."""
    model = models[arch]
    rng = random.Random(7)
    prompt, draft = random_ids(rng, 9), random_ids(rng, 8)
    wide = HybridTarget(model, kernel=kernel)
    wide_seq = wide.new_sequence()
    wide.prefill(wide_seq, prompt)
    together = wide.forward(wide_seq, draft)
    steps = HybridTarget(model)
    steps_seq = steps.new_sequence()
    steps.prefill(steps_seq, prompt)
    one_by_one = torch.cat([steps.forward(steps_seq, [t]) for t in draft])
    torch.testing.assert_close(together, one_by_one, atol=LOGIT_ATOL, rtol=0)
    # transformers' plain decoding (no recording: fused conv update, its own recurrent kernel), as generate() runs
    plain = DynamicCache(config=model.config)
    plain_logits = []
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt]), cache=plain, use_cache=True)
        for i, t in enumerate(draft):
            pos = torch.tensor([[len(prompt) + i]])
            plain_logits.append(model(input_ids=torch.tensor([[t]]), position_ids=pos, cache=plain).logits[0])
    torch.testing.assert_close(together, torch.cat(plain_logits), atol=LOGIT_ATOL, rtol=0)
    assert wide_seq.cache is not None and steps_seq.cache is not None
    wide.rollback(wide_seq, wide_seq.length)  # commit: trims the conv history the forward kept for rollback
    steps.rollback(steps_seq, steps_seq.length)
    assert_same_cache(wide_seq.cache, steps_seq.cache, STATE_ATOL)


def test_snapshot_replay_for_forwards_longer_than_max_recorded(models: dict[str, PreTrainedModel]) -> None:
    model = models["qwen3_next"]
    rng = random.Random(3)
    prompt, draft, nxt = random_ids(rng, 6), random_ids(rng, 7), rng.randrange(VOCAB)
    for a in (0, 3, 7):
        target = HybridTarget(model, max_recorded=2)
        seq = target.new_sequence()
        target.prefill(seq, prompt)
        target.forward(seq, draft)
        target.rollback(seq, len(prompt) + a)
        fresh, fresh_seq, _ = fresh_target(model, [*prompt, *draft[:a]])
        assert seq.cache is not None and fresh_seq.cache is not None
        assert_same_cache(seq.cache, fresh_seq.cache, STATE_ATOL)
        torch.testing.assert_close(target.forward(seq, [nxt]), fresh.forward(fresh_seq, [nxt]), atol=LOGIT_ATOL, rtol=0)


def test_rollback_to_before_the_last_forward_reprefills(models: dict[str, PreTrainedModel]) -> None:
    model = models["qwen3_5_moe"]
    rng = random.Random(4)
    prompt, first, second = random_ids(rng, 8), random_ids(rng, 3), random_ids(rng, 4)
    target = HybridTarget(model)
    seq = target.new_sequence()
    target.prefill(seq, prompt)
    target.forward(seq, first)
    target.rollback(seq, seq.length)
    target.forward(seq, second)
    for length in (10, 5):  # inside the first forward, then inside the prompt
        target.rollback(seq, length)
        _, fresh_seq, _ = fresh_target(model, [*prompt, *first][:length])
        assert seq.cache is not None and fresh_seq.cache is not None
        assert_same_cache(seq.cache, fresh_seq.cache, STATE_ATOL)
    target.rollback(seq, 0)
    assert seq.length == 0
    logits = target.forward(seq, prompt[:3])
    _, _, want = fresh_target(model, prompt[:3])
    torch.testing.assert_close(logits[-1], want, atol=LOGIT_ATOL, rtol=0)


def test_bounds_and_errors(models: dict[str, PreTrainedModel]) -> None:
    target = HybridTarget(models["qwen3_5"])
    seq = target.new_sequence()
    with pytest.raises(RuntimeError):
        target.forward(seq, [1])
    with pytest.raises(TokenError):
        target.prefill(seq, [])
    with pytest.raises(TokenError):
        target.prefill(seq, [VOCAB])
    target.prefill(seq, [1, 2, 3])
    with pytest.raises(ValueError):
        target.rollback(seq, 4)
    with pytest.raises(ValueError):
        target.rollback(seq, -1)
    with pytest.raises(TokenError):
        target.forward(seq, [])
    assert target.vocab_size == VOCAB and target.max_positions == 512
    with pytest.raises(ConfigError):
        HybridTarget(models["qwen3_5"], kernel="chunk")
    with pytest.raises(ConfigError):
        HybridTarget(models["qwen3_5"], max_recorded=0)


def test_is_hybrid_and_unsupported_models(models: dict[str, PreTrainedModel]) -> None:
    from lattice_testing.toy import toy_config, toy_model

    dense = toy_model(toy_config("qwen3"))
    assert all(is_hybrid(m) for m in models.values())
    assert not is_hybrid(dense)
    with pytest.raises(UnsupportedModelError):
        HybridTarget(dense)


def test_multimodal_qwen3_5_wrapper_rolls_back_exactly() -> None:
    """Released Qwen3.5 checkpoints are ``Qwen3_5ForConditionalGeneration`` (model type ``qwen3_5``)."""
    from transformers import AutoModelForImageTextToText, Qwen3_5Config

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = Qwen3_5Config(text_config=hybrid_config("qwen3_5").to_dict(), vision_config=vision)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, INIT_STD)
    assert is_hybrid(model)
    target = HybridTarget(model)
    seq = target.new_sequence()
    target.prefill(seq, [1, 2, 3, 4])
    target.forward(seq, [5, 6, 7])
    target.rollback(seq, 5)
    fresh, fresh_seq, _ = fresh_target(model, [1, 2, 3, 4, 5])
    assert seq.cache is not None and fresh_seq.cache is not None
    assert_same_cache(seq.cache, fresh_seq.cache, STATE_ATOL)
    torch.testing.assert_close(target.forward(seq, [9]), fresh.forward(fresh_seq, [9]), atol=LOGIT_ATOL, rtol=0)


def test_bfloat16_rollback_keeps_fp32_state_and_runs(models: dict[str, PreTrainedModel]) -> None:
    model = build_model("qwen3_5", seed=5).to(torch.bfloat16)
    target = HybridTarget(model)
    seq = target.new_sequence()
    target.prefill(seq, [5, 6, 7, 8])
    assert target.forward(seq, [1, 2, 3, 4]).dtype == torch.bfloat16
    target.rollback(seq, 6)
    assert seq.cache is not None
    for i in linear_layers(seq.cache):
        assert seq.cache.layers[i].recurrent_states[0].dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------------
# Losslessness of the speculative decode loop


class OracleDrafter(Drafter):
    """Proposes the true greedy continuation, corrupted on purpose at a random offset in most rounds.

    Per round it picks one of: the exact continuation (fully accepted), a corruption at offset 0 (immediately
    rejected) or at a random offset 1..n-1 (partly accepted). It records what happened to every proposal.
    """

    def __init__(self, reference: Sequence[int], seed: int) -> None:
        self.reference = list(reference)
        self.rng = random.Random(seed)
        self.outcomes: list[tuple[int, int]] = []
        """(drafted, accepted) per verification round with a draft."""

    def new_state(self, prompt_ids: Sequence[int], sampler=None, suffix_index=None) -> OracleState:
        return OracleState(self, prompt_ids)


class OracleState(DrafterState):
    def __init__(self, drafter: OracleDrafter, prompt_ids: Sequence[int]) -> None:
        self.drafter = drafter
        self.history = list(prompt_ids)
        self.pending: list[int] | None = None

    def extend(self, token_ids: Sequence[int]) -> None:
        if self.pending:
            self.drafter.outcomes.append((len(self.pending), len(token_ids) - 1))
        self.pending = None
        self.history.extend(token_ids)

    def propose(self, max_tokens: int) -> Proposal:
        rng = self.drafter.rng
        h = len(self.history)
        draft = self.drafter.reference[h : h + max_tokens]
        draft += [rng.randrange(VOCAB) for _ in range(max_tokens - len(draft))]
        mode = rng.choice(("full", "reject", "partial"))
        if mode != "full":
            at = 0 if mode == "reject" or len(draft) < 2 else rng.randrange(1, len(draft))
            draft[at] = (draft[at] + 1 + rng.randrange(VOCAB - 1)) % VOCAB
        self.pending = draft
        return Proposal(draft)


@pytest.mark.parametrize("kernel", hybrid.KERNELS)
@pytest.mark.parametrize("arch", ARCHES)
def test_speculative_decoding_is_lossless(models: dict[str, PreTrainedModel], arch: str, kernel: str) -> None:
    """Token for token equal to ``model.generate(do_sample=False)`` over 10 prompts, with every kind of round."""
    model = models[arch]
    rng = random.Random(11)
    new_tokens = 24
    outcomes: list[tuple[int, int]] = []
    for p in range(10):
        prompt = random_ids(rng, rng.randrange(2, 16))
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )
        reference = out[0].tolist()
        drafter = OracleDrafter(reference, seed=p)
        decoder = SpeculativeDecoder(
            HybridTarget(model, kernel=kernel), drafter, max_draft=rng.randrange(3, 7), adaptive=False
        )
        result = decoder.generate(prompt, new_tokens)
        assert result.token_ids == reference[len(prompt) :], f"prompt {p} diverged"
        m = result.metrics
        assert m.accepted_tokens == sum(a for _, a in drafter.outcomes)
        assert m.drafted_tokens == sum(d for d, _ in drafter.outcomes)
        outcomes += drafter.outcomes
    full = sum(a == d for d, a in outcomes)
    rejected = sum(a == 0 for _, a in outcomes)
    partial = sum(0 < a < d for d, a in outcomes)
    assert full and rejected and partial, (full, rejected, partial)
