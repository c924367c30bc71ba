"""Numerics of the MTP head against independent references.

* Golden: an MTP assembled from transformers' own Qwen3-Next / Qwen3.5 / Qwen3.5-MoE modules (decoder layer with
  full attention, MoE block, zero-centred RMSNorm, rotary embedding, DynamicCache), stepped over several positions
  with one shared cache, for a Qwen3-Next (per-expert checkpoint), a Qwen3.5-MoE (fused) and a dense Qwen3.5 head.
* One test per bug of the reference module (plain-``w`` norm, interleaved RoPE, swapped concat order, pre-norm
  chaining, off-by-one token/hidden pairing): each asserts the head matches the correct variant and differs from the
  buggy one by far more than the tolerance, so reintroducing the bug fails it.
* Cache behaviour: ``forward_many`` equals repeated ``forward_one``; rollback then re-forward equals a fresh run;
  bad inputs raise and change nothing.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lattice_inference.errors import TokenError
from lattice_inference.mtp import MtpConfig, MtpHead, load_mtp_head
from lattice_testing.mtp_checkpoint import build_tiny_checkpoint, embed_name, tiny_hf_config

ATOL = 1e-4
FAMILIES = ["qwen3_next", "qwen3_5_moe", "qwen3_5"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, MtpConfig, dict]]:
    root = tmp_path_factory.mktemp("mtp")
    return {fam: build_tiny_checkpoint(root / fam, fam, seed=i) for i, fam in enumerate(FAMILIES)}


# ------------------------------------------------------------------------------------------ transformers reference


class HfMtp:
    """The MTP built from transformers' own classes, as vLLM/SGLang build it from their model classes."""

    def __init__(self, family: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> None:
        from transformers import DynamicCache
        from transformers.models.qwen3_5 import modeling_qwen3_5 as q35
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35moe
        from transformers.models.qwen3_next import modeling_qwen3_next as qnext

        hf = tiny_hf_config(family)
        text = copy.deepcopy(hf.get_text_config())
        text.num_hidden_layers = 1
        text.layer_types = ["full_attention"]
        if family == "qwen3_next":
            text.mlp_only_layers = []
        text._attn_implementation = "eager"
        mod = {"qwen3_next": qnext, "qwen3_5_moe": q35moe, "qwen3_5": q35}[family]
        prefix = {"qwen3_next": "Qwen3Next", "qwen3_5_moe": "Qwen3_5Moe", "qwen3_5": "Qwen3_5"}[family]
        rotary = "Qwen3NextRotaryEmbedding" if family == "qwen3_next" else f"{prefix}TextRotaryEmbedding"
        norm_cls = getattr(mod, f"{prefix}RMSNorm")
        h, eps = text.hidden_size, text.rms_norm_eps
        self.layer = getattr(mod, f"{prefix}DecoderLayer")(text, 0).eval()
        state = {k.removeprefix("mtp.layers.0."): v for k, v in tensors.items() if k.startswith("mtp.layers.0.")}
        self.layer.load_state_dict(state, strict=True)
        self.rotary = getattr(mod, rotary)(text)
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            norm = norm_cls(h, eps=eps)
            norm.weight.data.copy_(tensors[f"mtp.{name}.weight"])
            self.norms[name] = norm
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.fc.weight.data.copy_(tensors["mtp.fc.weight"])
        self.embed = tensors[embed_name(family)].to(dtype)
        self.lm_head = tensors.get("lm_head.weight", tensors[embed_name(family)]).to(dtype)
        for module in (self.layer, self.fc, *self.norms.values()):
            module.to(dtype)
        self.dtype = dtype
        self.cache = DynamicCache(config=text)

    @torch.no_grad()
    def step(self, token: int, position: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.embed[token][None, None]
        hidden = hidden.to(self.dtype)
        x = self.fc(
            torch.cat(
                [self.norms["pre_fc_norm_embedding"](e), self.norms["pre_fc_norm_hidden"](hidden[None, None])], -1
            )
        )
        pos = torch.tensor([[position]])
        out = self.layer(x, position_embeddings=self.rotary(x, pos), position_ids=pos, cache=self.cache)
        h = self.norms["norm"](out)[0, 0]
        return F.linear(h, self.lm_head).float(), h.float()


def _steps(head_like, steps: int, cfg: MtpConfig, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three steps fed with 'target' hiddens (catch-up), then drafting steps chaining the head's own hidden."""
    gen = torch.Generator().manual_seed(seed)
    target_h = torch.randn(3, cfg.hidden_size, generator=gen) * 2
    tokens = torch.randint(0, cfg.vocab_size, (3,), generator=gen).tolist()
    outs = []
    for pos in range(steps):
        if pos < 3:
            tok, hid = tokens[pos], target_h[pos]
        else:
            tok, hid = int(torch.argmax(outs[-1][0])), outs[-1][1]
        outs.append(
            head_like.step(tok, pos, hid) if isinstance(head_like, HfMtp) else head_like.forward_one(tok, pos, hid)
        )
    return outs


@pytest.mark.parametrize("family", FAMILIES)
def test_golden_against_transformers_modules(family: str, checkpoints) -> None:
    path, cfg, tensors = checkpoints[family]
    head = load_mtp_head(path, dtype=torch.float32)
    expected_layout = {"qwen3_next": "per_expert", "qwen3_5_moe": "fused", "qwen3_5": "dense"}[family]
    assert head.layout == expected_layout
    ref = _steps(HfMtp(family, tensors), 6, cfg, seed=7)
    got = _steps(head, 6, cfg, seed=7)
    for pos, ((rl, rh), (gl, gh)) in enumerate(zip(ref, got, strict=True)):
        assert gl.dtype == torch.float32 and gl.shape == (cfg.vocab_size,) and gh.shape == (cfg.hidden_size,)
        torch.testing.assert_close(gh, rh, atol=ATOL, rtol=ATOL, msg=f"hidden at position {pos}")
        torch.testing.assert_close(gl, rl, atol=ATOL, rtol=ATOL, msg=f"logits at position {pos}")
    # The outputs are far from trivial: different positions give different logits.
    assert (got[0][0] - got[1][0]).abs().max() > 0.5


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_5"])
def test_bfloat16_golden_against_transformers_modules(family: str, checkpoints) -> None:
    """In bfloat16 the head mirrors transformers' casts (norms and softmaxes in fp32, matmuls in bf16)."""
    path, cfg, tensors = checkpoints[family]
    head = load_mtp_head(path, dtype=torch.bfloat16)
    assert head.dtype == torch.bfloat16
    ref = _steps(HfMtp(family, tensors, torch.bfloat16), 5, cfg, seed=3)
    got = _steps(head, 5, cfg, seed=3)
    fp32 = _steps(load_mtp_head(path, dtype=torch.float32), 5, cfg, seed=3)
    for (rl, rh), (gl, gh), (fl, _) in zip(ref, got, fp32, strict=True):
        assert gl.dtype == torch.float32 and gh.dtype == torch.float32
        torch.testing.assert_close(gl, rl, atol=0.05, rtol=0.01)
        torch.testing.assert_close(gh, rh, atol=0.02, rtol=0.01)
        assert (gl - fl).abs().max() < 0.1 * fl.abs().max()  # and stays close to the float32 head


# ------------------------------------------------------------------------------------------ bug-variant references


def manual_mtp(tensors: dict, cfg: MtpConfig, family: str, bug: str = "") -> callable:
    """A hand-written §2.1 MTP (float32) with one reference bug optionally switched on; returns step()."""
    p, eps = "mtp.layers.0.", cfg.rms_norm_eps
    n_h, n_kv, hd, rd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim
    emb = tensors[embed_name(family)]
    lm = tensors.get("lm_head.weight", emb)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []

    def norm(x, w):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return y * (w if bug == "plain_norm" else 1 + w)

    def rope(v, pos):  # v [heads, hd]
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
        cos, sin = torch.cos(pos * inv), torch.sin(pos * inv)
        v = v.clone()
        if bug == "interleaved_rope":
            a, b = v[:, 0:rd:2].clone(), v[:, 1:rd:2].clone()
            v[:, 0:rd:2], v[:, 1:rd:2] = a * cos - b * sin, a * sin + b * cos
        else:
            a, b = v[:, : rd // 2].clone(), v[:, rd // 2 : rd].clone()
            v[:, : rd // 2], v[:, rd // 2 : rd] = a * cos - b * sin, b * cos + a * sin
        return v

    def swiglu(y, g, u, d):
        return d @ (F.silu(g @ y) * (u @ y))

    def step(tok: int, pos: int, h_prev: torch.Tensor):
        e_n = norm(emb[tok], tensors["mtp.pre_fc_norm_embedding.weight"])
        h_n = norm(h_prev, tensors["mtp.pre_fc_norm_hidden.weight"])
        x = tensors["mtp.fc.weight"] @ (torch.cat([h_n, e_n]) if bug == "swapped_concat" else torch.cat([e_n, h_n]))
        r = x
        y = norm(x, tensors[p + "input_layernorm.weight"])
        qg = (tensors[p + "self_attn.q_proj.weight"] @ y).view(n_h, 2 * hd)
        q, g = qg[:, :hd], qg[:, hd:]
        k = (tensors[p + "self_attn.k_proj.weight"] @ y).view(n_kv, hd)
        v = (tensors[p + "self_attn.v_proj.weight"] @ y).view(n_kv, hd)
        q = rope(norm(q, tensors[p + "self_attn.q_norm.weight"]), pos)
        k = rope(norm(k, tensors[p + "self_attn.k_norm.weight"]), pos)
        keys.append(k)
        values.append(v)
        kk, vv = torch.stack(keys), torch.stack(values)  # [L, n_kv, hd]
        o = torch.empty(n_h, hd)
        for head in range(n_h):
            kv = head // (n_h // n_kv)
            a = torch.softmax(kk[:, kv] @ q[head] * hd**-0.5, dim=0)
            o[head] = a @ vv[:, kv]
        x = r + tensors[p + "self_attn.o_proj.weight"] @ (o.reshape(-1) * torch.sigmoid(g.reshape(-1)))
        r = x
        y = norm(x, tensors[p + "post_attention_layernorm.weight"])
        if cfg.is_moe:
            probs = torch.softmax(tensors[p + "mlp.gate.weight"] @ y, dim=0)
            top, idx = torch.topk(probs, cfg.num_experts_per_tok)
            top = top / top.sum()
            gu, dn, inter = (
                tensors[p + "mlp.experts.gate_up_proj"],
                tensors[p + "mlp.experts.down_proj"],
                cfg.moe_intermediate_size,
            )
            mlp = sum(
                w * swiglu(y, gu[e, :inter], gu[e, inter:], dn[e]) for w, e in zip(top, idx.tolist(), strict=True)
            )
            s = "mlp.shared_expert."
            sh = swiglu(
                y,
                tensors[p + s + "gate_proj.weight"],
                tensors[p + s + "up_proj.weight"],
                tensors[p + s + "down_proj.weight"],
            )
            mlp = mlp + torch.sigmoid(tensors[p + "mlp.shared_expert_gate.weight"][0] @ y) * sh
        else:
            mlp = swiglu(
                y,
                tensors[p + "mlp.gate_proj.weight"],
                tensors[p + "mlp.up_proj.weight"],
                tensors[p + "mlp.down_proj.weight"],
            )
        pre = r + mlp
        h = norm(pre, tensors["mtp.norm.weight"])
        return lm @ h, (pre if bug == "prenorm_chain" else h)

    return step


def _run_manual(step, cfg: MtpConfig, seed: int, steps: int = 5):
    gen = torch.Generator().manual_seed(seed)
    hid = torch.randn(cfg.hidden_size, generator=gen) * 2
    tokens = torch.randint(0, cfg.vocab_size, (2,), generator=gen).tolist()
    outs = []
    for pos in range(steps):  # two target-fed steps, then chained drafting
        if pos < 2:
            tok, h = tokens[pos], hid * (pos + 1)
        else:
            tok, h = int(torch.argmax(outs[-1][0])), outs[-1][1]
        outs.append(step(tok, pos, h))
    return torch.stack([o[0] for o in outs])


@pytest.mark.parametrize("family", FAMILIES)
def test_manual_reference_agrees_with_head(family: str, checkpoints) -> None:
    path, cfg, tensors = checkpoints[family]
    head = load_mtp_head(path, dtype=torch.float32)
    torch.testing.assert_close(
        _run_manual(head.forward_one, cfg, 1),
        _run_manual(manual_mtp(tensors, cfg, family), cfg, 1),
        atol=ATOL,
        rtol=ATOL,
    )


@pytest.mark.parametrize("bug", ["plain_norm", "interleaved_rope", "swapped_concat", "prenorm_chain"])
def test_head_is_not_the_reference_bug(bug: str, checkpoints) -> None:
    """The reference module's numeric bugs give visibly different logits; the head must match the fixed math."""
    path, cfg, tensors = checkpoints["qwen3_5_moe"]
    head = load_mtp_head(path, dtype=torch.float32)
    got = _run_manual(head.forward_one, cfg, 2)
    good = _run_manual(manual_mtp(tensors, cfg, "qwen3_5_moe"), cfg, 2)
    buggy = _run_manual(manual_mtp(tensors, cfg, "qwen3_5_moe", bug), cfg, 2)
    torch.testing.assert_close(got, good, atol=ATOL, rtol=ATOL)
    assert (got - buggy).abs().max() > 100 * ATOL, f"the {bug} variant is indistinguishable"


def test_zero_norm_weights_mean_pure_normalisation(tmp_path: Path) -> None:
    """Released checkpoints store (1+w) norms near zero: with w = 0 the head must still produce signal."""
    path, cfg, tensors = build_tiny_checkpoint(tmp_path / "z", "qwen3_5")
    for name in list(tensors):
        if name.endswith("norm.weight") or "norm_" in name:
            tensors[name] = torch.zeros_like(tensors[name])
    from lattice_testing.mtp_checkpoint import tiny_hf_config, write_checkpoint

    write_checkpoint(path, tiny_hf_config("qwen3_5"), tensors)
    head = load_mtp_head(path, dtype=torch.float32)
    logits, hidden = head.forward_one(1, 0, torch.randn(cfg.hidden_size))
    assert torch.allclose(hidden.pow(2).mean(), torch.tensor(1.0), atol=1e-3)  # unit RMS after mtp.norm
    assert logits.abs().max() > 0.1  # plain w would give all zeros


def test_hidden_is_post_norm_and_scores_to_the_logits(checkpoints) -> None:
    path, cfg, tensors = checkpoints["qwen3_next"]
    head = load_mtp_head(path, dtype=torch.float32)
    logits, hidden = head.forward_one(4, 0, torch.randn(cfg.hidden_size))
    torch.testing.assert_close(F.linear(hidden, tensors["lm_head.weight"]), logits, atol=ATOL, rtol=ATOL)


def _counting_head(family: str = "qwen3_5") -> MtpHead:
    """A head whose draft is always (input token + 1) mod V, whatever the hidden: fc passes the embedding half,
    attention and MLP outputs are zero, and lm_head row j is the embedding of j - 1."""
    from lattice_inference.mtp.weights import MtpWeights

    cfg = MtpConfig.from_hf_config(tiny_hf_config(family).to_dict())
    h, v = cfg.hidden_size, cfg.vocab_size
    gen = torch.Generator().manual_seed(5)
    emb = torch.randn(v, h, generator=gen)
    emb = emb / emb.norm(dim=-1, keepdim=True)
    z = torch.zeros
    w = MtpWeights(
        fc=torch.cat([torch.eye(h), z(h, h)], dim=1),
        pre_fc_norm_embedding=z(h), pre_fc_norm_hidden=z(h), norm=z(h),
        input_layernorm=z(h), post_attention_layernorm=z(h),
        q_proj=torch.randn(2 * cfg.num_attention_heads * cfg.head_dim, h, generator=gen),
        k_proj=torch.randn(cfg.num_key_value_heads * cfg.head_dim, h, generator=gen),
        v_proj=torch.randn(cfg.num_key_value_heads * cfg.head_dim, h, generator=gen),
        o_proj=z(h, cfg.num_attention_heads * cfg.head_dim),
        q_norm=z(cfg.head_dim), k_norm=z(cfg.head_dim),
        embed_tokens=emb, lm_head=torch.roll(emb, 1, dims=0), layout="dense",
        mlp_gate=z(40, h), mlp_up=z(40, h), mlp_down=z(h, 40),
    )  # fmt: skip
    return MtpHead(cfg, w)


def test_token_hidden_pairing_follows_vllm() -> None:
    """forward_one/draft_tokens take (x_{t+1}, position t, h_t) and predict x_{t+2} (vLLM EagleProposer: input ids
    shifted left by one, positions and hiddens unshifted). On a target that counts up (x_t = t) and an MTP that
    learned "next = input + 1", the vLLM pairing drafts x_{t+2}.. and all of them verify; the reference module's
    pairing (feeding x_t with h_t and expecting the first draft to be x_{t+1}) is off by one on every draft."""
    head = _counting_head()
    t = 6
    target_hiddens = torch.randn(t + 1, head.config.hidden_size)
    head.prefill(target_hiddens[:t], list(range(1, t + 1)), 0)  # slot p from (h_p, x_{p+1})
    assert head.cache_len == t
    drafts = head.draft_tokens(t + 1, t, target_hiddens[t], num_tokens=3)  # x_{t+1} = t + 1
    assert drafts == [t + 2, t + 3, t + 4]
    head.rollback_cache_to(t)
    seed_style = head.draft_tokens(t, t, target_hiddens[t], num_tokens=3)  # the off-by-one input x_t
    assert seed_style[0] != t + 2 and seed_style != drafts


def test_prefill_slot_p_holds_h_p_with_the_next_token(checkpoints) -> None:
    """prefill(h[:P-1], x[1:P], 0) builds slot p from (h_p, x_{p+1}) at RoPE position p, as vLLM's propose() does
    over a prefill chunk; the reference module never filled the MTP cache over the prompt at all."""
    path, cfg, _ = checkpoints["qwen3_5_moe"]
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, cfg.vocab_size, (6,), generator=gen).tolist()
    h = torch.randn(6, cfg.hidden_size, generator=gen)
    head, ref, shifted = load_mtp_head(path), load_mtp_head(path), load_mtp_head(path)
    head.prefill(h[:5], prompt[1:6], 0)
    for p in range(5):
        ref.forward_one(prompt[p + 1], p, h[p])
        shifted.forward_one(prompt[p], p, h[p])  # the reference module's pairing (x_t with h_t)
    assert head.cache_len == ref.cache_len == 5
    torch.testing.assert_close(head._k[:5], ref._k[:5], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(head._v[:5], ref._v[:5], atol=ATOL, rtol=ATOL)
    assert (head._k[:5] - shifted._k[:5]).abs().max() > 100 * ATOL
    # The next draft step continues at position 5 with the target's h_5 and x_6 = argmax of its logits.
    logits, _ = head.forward_one(3, 5, h[5])
    expected, _ = ref.forward_one(3, 5, h[5])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=ATOL)


# ------------------------------------------------------------------------------------------ cache behaviour


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_forward_many_equals_repeated_forward_one(family: str, checkpoints) -> None:
    path, cfg, _ = checkpoints[family]
    a, b = load_mtp_head(path), load_mtp_head(path)
    gen = torch.Generator().manual_seed(11)
    hid = torch.randn(7, cfg.hidden_size, generator=gen)
    toks = torch.randint(0, cfg.vocab_size, (7,), generator=gen)
    la, ha = a.forward_many(toks[:2], [0, 1], hid[:2])
    singles = [b.forward_one(int(toks[i]), i, hid[i]) for i in range(7)]
    lc, hc = a.forward_many(toks[2:], range(2, 7), hid[2:])
    torch.testing.assert_close(torch.cat([la, lc]), torch.stack([s[0] for s in singles]), atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(torch.cat([ha, hc]), torch.stack([s[1] for s in singles]), atol=ATOL, rtol=ATOL)
    assert a.cache_len == b.cache_len == 7
    no_logits, h_only = a.forward_many([1], [7], hid[:1], return_logits=False)
    assert no_logits is None and h_only.shape == (1, cfg.hidden_size)


def test_rollback_then_reforward_equals_fresh(checkpoints) -> None:
    path, cfg, _ = checkpoints["qwen3_5_moe"]
    gen = torch.Generator().manual_seed(2)
    hid = torch.randn(6, cfg.hidden_size, generator=gen)

    def run(head: MtpHead, toks: list[int], start: int, hiddens: torch.Tensor):
        return [head.forward_one(t, start + i, hiddens[i]) for i, t in enumerate(toks)]

    head = load_mtp_head(path)
    run(head, [1, 2, 3, 4, 5], 0, hid[:5])
    head.rollback_cache_to(2)
    assert head.cache_len == 2
    again = run(head, [7, 8], 2, hid[4:6])
    fresh = load_mtp_head(path)
    run(fresh, [1, 2], 0, hid[:2])
    expected = run(fresh, [7, 8], 2, hid[4:6])
    for (la, ha), (le, he) in zip(again, expected, strict=True):  # bit-exact: same kernels, same cache content
        assert torch.equal(la, le) and torch.equal(ha, he)
    # The batched form agrees too (up to gemm-vs-gemv rounding).
    head.rollback_cache_to(2)
    logits, _ = head.forward_many([7, 8], [2, 3], hid[4:6])
    torch.testing.assert_close(logits, torch.stack([e[0] for e in expected]), atol=ATOL, rtol=ATOL)
    head.reset_cache()
    assert head.cache_len == 0
    with pytest.raises(ValueError, match="roll the MTP cache back"):
        head.rollback_cache_to(1)


def test_invalid_inputs_raise_and_leave_the_cache_alone(checkpoints) -> None:
    path, cfg, _ = checkpoints["qwen3_5"]
    head = load_mtp_head(path, max_seq_len=4)
    h = torch.randn(cfg.hidden_size)
    head.forward_one(0, 0, h)
    before = head.forward_many([1], [1], h[None], return_logits=True)
    head.rollback_cache_to(1)
    bad = [
        (TokenError, "vocab_size", lambda: head.forward_one(cfg.vocab_size, 1, h)),
        (TokenError, "out of range", lambda: head.forward_one(-1, 1, h)),
        (TokenError, "int", lambda: head.forward_one(1.0, 1, h)),  # type: ignore[arg-type]
        (ValueError, "contiguous", lambda: head.forward_one(1, 2, h)),
        (ValueError, "contiguous", lambda: head.forward_one(1, 0, h)),
        (ValueError, "shape", lambda: head.forward_one(1, 1, h[:-1])),
        (ValueError, "shape", lambda: head.forward_many([1, 2], [1, 2], h[None])),
        (ValueError, "positions", lambda: head.forward_many([1, 2], [1], torch.stack([h, h]))),
        (ValueError, "max_seq_len", lambda: head.forward_many([1, 2, 3, 4], range(1, 5), h.expand(4, -1))),
        (TokenError, "at least one", lambda: head.forward_many([], [], h.new_zeros(0, cfg.hidden_size))),
    ]
    for err, match, call in bad:
        with pytest.raises(err, match=match):
            call()
        assert head.cache_len == 1
    assert issubclass(TokenError, ValueError)
    torch.testing.assert_close(head.forward_many([1], [1], h[None]), before, atol=0, rtol=0)


def test_draft_tokens_chain_forward_one_and_draft_vocab_restricts_the_argmax(checkpoints) -> None:
    path, cfg, _ = checkpoints["qwen3_next"]
    head, ref = load_mtp_head(path), load_mtp_head(path)
    h = torch.randn(cfg.hidden_size)
    drafts = head.draft_tokens(5, 0, h, eos_token_ids=())
    assert len(drafts) == cfg.num_drafts == 3 and head.cache_len == 3
    tok, hid, expected, full_logits = 5, h, [], []
    for pos in range(3):
        logits, hid = ref.forward_one(tok, pos, hid)
        tok = int(torch.argmax(logits))
        expected.append(tok)
        full_logits.append(logits)
    assert drafts == expected
    head.rollback_cache_to(0)
    assert head.draft_tokens(5, 0, h, num_tokens=3, eos_token_ids=[expected[0]]) == expected[:1]  # stops at EOS
    # Restricted vocabulary: the first draft is the argmax of the full logits over the allowed ids.
    allowed = [i for i in range(cfg.vocab_size) if i != expected[0]][::2]
    head.set_draft_vocab(allowed)
    head.rollback_cache_to(0)
    first = head.draft_tokens(5, 0, h, num_tokens=1)[0]
    assert first == allowed[int(torch.argmax(full_logits[0][allowed]))] and first != expected[0]
    head.set_draft_vocab(None)
    head.rollback_cache_to(0)
    assert head.draft_tokens(5, 0, h) == expected
    with pytest.raises(TokenError, match="out of range"):
        head.set_draft_vocab([0, cfg.vocab_size])
    with pytest.raises(TokenError, match="at least one"):
        head.set_draft_vocab([])
    with pytest.raises(ValueError, match="must equal cache_len"):
        head.draft_tokens(5, 1, h)
    assert head.cache_len == 3


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_draft_with_catch_up_equals_prefill_then_draft(family: str, checkpoints) -> None:
    """The drafter's fused round (catch-up slots + first draft step in one forward) changes nothing but the
    number of forwards: same drafts, same cache slots, same next step."""
    path, cfg, _ = checkpoints[family]
    gen = torch.Generator().manual_seed(21)
    hid = torch.randn(9, cfg.hidden_size, generator=gen)
    toks = torch.randint(0, cfg.vocab_size, (9,), generator=gen).tolist()
    fused, split = load_mtp_head(path), load_mtp_head(path)
    for head in (fused, split):
        head.prefill(hid[:2], toks[1:3], 0)
    split.prefill(hid[2:6], toks[3:7], 2)
    expected = split.draft_tokens(toks[7], 6, hid[6], num_tokens=3)
    with pytest.raises(ValueError, match="minus 4 catch-up rows must equal cache_len 2"):
        fused.draft_tokens(toks[7], 7, hid[6], num_tokens=3, catch_up=(hid[2:6], toks[3:7]))
    assert fused.cache_len == 2
    drafts = fused.draft_tokens(toks[7], 6, hid[6], num_tokens=3, catch_up=(hid[2:6], toks[3:7]))
    assert drafts == expected and fused.cache_len == split.cache_len == 9
    torch.testing.assert_close(fused._k[:9], split._k[:9], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(fused._v[:9], split._v[:9], atol=ATOL, rtol=ATOL)
    with pytest.raises(ValueError, match="shape"):
        fused.draft_tokens(toks[7], 9, hid[6], catch_up=(hid[:2], toks[:3]))
