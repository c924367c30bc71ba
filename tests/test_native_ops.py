"""The lean forward's native row-wise ops (`kernels/native_ops.py`, ``csrc/lean_ops.cpp``).

Each op against transformers' own modules (Llama/Qwen3 RMSNorm, rotary embedding with q/k norms, the SiLU gate)
or a float64 attention reference, in float32 and bfloat16; and each op's rows (and each row's heads) equal to
the same rows computed one at a time, bitwise: the property lossless verification rests on. The extension is
built here on first use; these tests fail, not skip, where it cannot be built unless ``LATTICE_NATIVE=0``.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from lattice_inference.kernels import native_ops

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops():
    if not native_ops.enabled():
        pytest.skip("LATTICE_NATIVE=0")
    built = native_ops.ops()
    assert built is not None, native_ops.unavailable()
    return built


def _rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_are_transformers_rmsnorm_row_by_row(ops, dtype):
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * _rand(96, dtype=dtype, seed=1))
    x, y = _rand(7, 96, dtype=dtype), _rand(7, 96, dtype=dtype, seed=2)
    out = ops.rms_norm(x, norm.weight.detach(), 1e-5)
    want = norm(x)
    tolerance = 0 if dtype == torch.bfloat16 else 1e-6  # float32: the variance sums in another order
    assert (out.float() - want.float()).abs().max() <= tolerance * max(1.0, want.float().abs().max())
    for i in range(7):
        assert torch.equal(ops.rms_norm(x[i : i + 1].contiguous(), norm.weight.detach(), 1e-5), out[i : i + 1])
    summed = x.clone()
    fused = ops.add_rms_norm(summed, y, norm.weight.detach(), 1e-5)
    assert torch.equal(summed, x + y)  # the residual is updated in place, rounded as torch rounds it
    assert torch.equal(fused, ops.rms_norm(x + y, norm.weight.detach(), 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_gate_is_the_mlps_activation(ops, dtype):
    gate_up = _rand(5, 2 * 100, dtype=dtype) * 4
    out = ops.silu_mul(gate_up)
    want = torch.nn.functional.silu(gate_up[:, :100]) * gate_up[:, 100:]
    assert (out.float() - want.float()).abs().max() <= (1e-6 if dtype == torch.float32 else 0.02) * 16
    for i in range(5):
        assert torch.equal(ops.silu_mul(gate_up[i : i + 1].contiguous()), out[i : i + 1])


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_and_cache_write_match_transformers(ops, dtype, qk_norm):
    heads, kv_heads, dim, n, start = 4, 2, 16, 5, 9
    qkv = _rand(n, (heads + 2 * kv_heads) * dim, dtype=dtype)
    angles = torch.arange(start, start + n)[:, None] * torch.linspace(0.01, 1, dim // 2)[None]
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    q_norm = LlamaRMSNorm(dim, eps=1e-6).to(dtype)
    with torch.no_grad():
        q_norm.weight.copy_(1 + 0.1 * _rand(dim, dtype=dtype, seed=3))
    k_cache, v_cache = torch.zeros(kv_heads, 32, dim, dtype=dtype), torch.zeros(kv_heads, 32, dim, dtype=dtype)
    weight = q_norm.weight.detach() if qk_norm else None
    q = ops.rope_qk_cache(qkv, weight, weight, 1e-6, cos, sin, k_cache, v_cache, start, heads, kv_heads)
    q_ref = qkv[:, : heads * dim].view(1, n, heads, dim)
    k_ref = qkv[:, heads * dim : (heads + kv_heads) * dim].view(1, n, kv_heads, dim)
    if qk_norm:
        q_ref, k_ref = q_norm(q_ref), q_norm(k_ref)
    q_ref, k_ref = apply_rotary_pos_emb(q_ref.transpose(1, 2), k_ref.transpose(1, 2), cos[None], sin[None])
    tolerance = 0 if dtype == torch.bfloat16 else 1e-6
    assert (q - q_ref[0].float()).abs().max() <= tolerance * 8
    assert (k_cache[:, start : start + n].float() - k_ref[0].float()).abs().max() <= tolerance * 8
    assert torch.equal(
        v_cache[:, start : start + n], qkv[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim).transpose(0, 1)
    )
    assert not k_cache[:, :start].any() and not k_cache[:, start + n :].any()  # only its rows are written
    with pytest.raises(RuntimeError, match="qkv width"):
        ops.rope_qk_cache(qkv[:, :-1].contiguous(), None, None, 1e-6, cos, sin, k_cache, v_cache, 0, heads, kv_heads)
    with pytest.raises(RuntimeError, match="the cache holds 32 rows, 35 needed"):
        ops.rope_qk_cache(qkv, None, None, 1e-6, cos, sin, k_cache, v_cache, 30, heads, kv_heads)


def _keys(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Key rows, flat, and each row's (begin, end) span of them."""
    spans, flat = [], []
    for keys in lists:
        spans.append([len(flat), len(flat) + len(keys)])
        flat.extend(keys)
    return torch.tensor(flat), torch.tensor(spans)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rows_see_their_keys_and_equal_one_row_calls(ops, dtype):
    heads, kv_heads, dim = 6, 2, 32
    k_cache, v_cache = _rand(kv_heads, 64, dim, dtype=dtype, seed=4), _rand(kv_heads, 64, dim, dtype=dtype, seed=5)
    visible = [list(range(13 + i)) for i in range(4)] + [[*range(13), 15, 17], [0, 5, 9, 40]]  # chain, tree paths
    q = _rand(heads, len(visible), dim, dtype=torch.float32, seed=6)
    out = ops.attention(q, k_cache, v_cache, *_keys(visible), 0.2)
    for r, keys in enumerate(visible):
        alone = ops.attention(q[:, r : r + 1].contiguous(), k_cache, v_cache, *_keys([keys]), 0.2)
        assert torch.equal(alone[0], out[r]), r
        for head in range(heads):
            kv = head // (heads // kv_heads)
            k, v = k_cache[kv, keys].double(), v_cache[kv, keys].double()
            want = torch.softmax(q[head, r].double() @ k.T * 0.2, -1) @ v
            got = out[r, head * dim : (head + 1) * dim].double()
            assert (got - want).abs().max() <= (1e-5 if dtype == torch.float32 else 1e-2), (r, head)
    chain = torch.arange(16)  # rows sharing one key list: each a prefix of it
    spans = torch.tensor([[0, 13 + i] for i in range(4)])
    assert torch.equal(ops.attention(q[:, :4].contiguous(), k_cache, v_cache, chain, spans, 0.2), out[:4])
    with pytest.raises(RuntimeError, match="key row 64 outside 64"):
        ops.attention(q[:, :1].contiguous(), k_cache, v_cache, *_keys([[0, 64]]), 0.2)
    with pytest.raises(RuntimeError, match=r"row 0 sees keys 0\.\.17 of 16"):
        ops.attention(q[:, :1].contiguous(), k_cache, v_cache, chain, torch.tensor([[0, 17]]), 0.2)


def test_a_float16_cache_holds_the_float32_rows_rounded_once_and_attention_reads_them_exactly(ops):
    """Under float32 activations the caches may be float16 (``kv_cache``): the cache write stores each key and value
    rounded to nearest float16 (the float32 cache's values, ``.half()``), and attention over a float16 cache is
    attention over the same values widened to float32, bit for bit, with float32 output; row-exact as ever."""
    heads, kv_heads, dim, n, start = 6, 2, 64, 5, 7
    qkv = _rand(n, (heads + 2 * kv_heads) * dim, dtype=torch.float32) * 3
    angles = torch.arange(start, start + n)[:, None] * torch.linspace(0.01, 1, dim // 2)[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    caches = {dt: (torch.zeros(kv_heads, 16, dim, dtype=dt), torch.zeros(kv_heads, 16, dim, dtype=dt))
              for dt in (torch.float32, torch.float16)}  # fmt: skip
    queries = {dt: ops.rope_qk_cache(qkv, None, None, 1e-6, cos, sin, *kv, start, heads, kv_heads)
               for dt, kv in caches.items()}  # fmt: skip
    assert torch.equal(queries[torch.float16], queries[torch.float32])
    for wide, half in zip(caches[torch.float32], caches[torch.float16], strict=True):
        assert half.dtype == torch.float16 and torch.equal(half, wide.half())
        assert not torch.equal(half.float(), wide)  # the rounding is real: the test could fail
    q, (k16, v16) = queries[torch.float16], caches[torch.float16]
    visible = [list(range(start + 1 + r)) for r in range(n)]
    out = ops.attention(q, k16, v16, *_keys(visible), 0.125)
    assert out.dtype == torch.float32
    assert torch.equal(out, ops.attention(q, k16.float(), v16.float(), *_keys(visible), 0.125))
    for r, keys in enumerate(visible):
        alone = ops.attention(q[:, r : r + 1].contiguous(), k16, v16, *_keys([keys]), 0.125)
        assert torch.equal(alone[0], out[r]), r


@pytest.mark.parametrize("dots", [True, False])
@pytest.mark.parametrize("dim", [64, 128])
def test_bfloat16_attention_at_model_head_sizes_is_row_exact_and_rounds_as_bfloat16_attention(ops, dim, dots):
    """Head sizes 64 and 128 in bfloat16 run on AVX512-BF16 dot products where the CPU has them (``dots``; else,
    and with ``attention_bf16_dots(False)``, on float32 lanes): each row equals that row alone at every key count
    (odd ones leave a key pair half empty, 16-key blocks half full), and the outputs stay within what rounding the
    query and the probabilities to bfloat16 costs (transformers' bfloat16 attention rounds them so too)."""
    heads, kv_heads = 9, 3
    k_cache = _rand(kv_heads, 160, dim, dtype=torch.bfloat16, seed=7)
    v_cache = _rand(kv_heads, 160, dim, dtype=torch.bfloat16, seed=8)
    visible = [list(range(1 + 7 * i)) for i in range(16)] + [[*range(20), 31, 57], [3, 90, 150]]
    q = _rand(heads, len(visible), dim, dtype=torch.float32, seed=9)
    scale = dim**-0.5
    ops.attention_bf16_dots(dots)
    try:
        out = ops.attention(q, k_cache, v_cache, *_keys(visible), scale)
        chain = torch.arange(106)  # the first 16 rows as prefixes of one list, computed together
        spans = torch.tensor([[0, 1 + 7 * i] for i in range(16)])
        assert torch.equal(ops.attention(q[:, :16].contiguous(), k_cache, v_cache, chain, spans, scale), out[:16])
        for r, keys in enumerate(visible):
            alone = ops.attention(q[:, r : r + 1].contiguous(), k_cache, v_cache, *_keys([keys]), scale)
            assert torch.equal(alone[0], out[r]), r
            for head in range(heads):
                k, v = k_cache[head // 3, keys].double(), v_cache[head // 3, keys].double()
                want = torch.softmax(q[head, r].double() @ k.T * scale, -1) @ v
                got = out[r, head * dim : (head + 1) * dim].double()
                assert (got - want).abs().max() <= 1.5e-2, (r, head, float((got - want).abs().max()))
    finally:
        ops.attention_bf16_dots(native_ops.bf16_attention_dots())


@pytest.mark.parametrize("dots", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prefill_sized_chain_splits_into_runs_and_each_row_equals_it_alone(ops, dtype, dots):
    """A prefill's causal chain of 150 rows (past `RUN_ROWS` = 32: runs of at most 32 rows, dealt to the threads
    from both ends of the prompt, several per key-value head): every row equals that row computed alone, bitwise,
    and a chain of its first 40 rows gives the same rows (other runs, the same results)."""
    heads, kv_heads, dim, n = 9, 3, 64, 150
    k_cache = _rand(kv_heads, n, dim, dtype=dtype, seed=10)
    v_cache = _rand(kv_heads, n, dim, dtype=dtype, seed=11)
    q = _rand(heads, n, dim, dtype=torch.float32, seed=12)
    chain, spans = torch.arange(n), torch.tensor([[0, r + 1] for r in range(n)])
    scale = dim**-0.5
    ops.attention_bf16_dots(dots)
    try:
        out = ops.attention(q, k_cache, v_cache, chain, spans, scale)
        head = ops.attention(q[:, :40].contiguous(), k_cache, v_cache, chain, spans[:40].contiguous(), scale)
        assert torch.equal(head, out[:40])
        for r in (0, 1, 31, 32, 33, 63, 64, 100, 148, 149):
            alone = ops.attention(q[:, r : r + 1].contiguous(), k_cache, v_cache, chain, spans[r : r + 1], scale)
            assert torch.equal(alone[0], out[r]), r
    finally:
        ops.attention_bf16_dots(native_ops.bf16_attention_dots())


def test_torch_held_to_avx2_holds_the_build_and_bfloat16_counts_as_emulated(monkeypatch):
    """``ATEN_CPU_CAPABILITY=avx2`` on an AVX-512 CPU: the native ops are built without AVX-512 (their own build
    directory) and ``--dtype auto`` treats bfloat16 as emulated, as on an AVX2-only CPU."""
    from lattice_inference import cpu_features

    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert cpu_features.isa_ceiling() == "avx512" and cpu_features.has_native_bf16()
    assert native_ops.compiler_flags() == native_ops.FLAGS
    native = native_ops.build_directory()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert cpu_features.isa_ceiling() == "avx2" and not cpu_features.has_native_bf16()
    assert native_ops.compiler_flags() == (*native_ops.FLAGS, "-mno-avx512f")
    assert native_ops.build_directory() != native
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert not cpu_features.has_native_bf16()  # no AVX512_BF16 or AMX: emulated whatever torch may use


def _bad_calls(ops) -> list[tuple[str, object]]:
    """(expected message, call) pairs: each call hands an op a tensor it must not read."""
    x, w = _rand(3, 64, dtype=torch.float32), torch.ones(64)
    heads, kv_heads, dim = 2, 1, 16
    qkv = _rand(3, (heads + 2 * kv_heads) * dim, dtype=torch.float32)
    cos = sin = torch.ones(3, dim)
    cache = torch.zeros(kv_heads, 8, dim)
    q = _rand(heads, 1, dim, dtype=torch.float32)
    keys, spans = _keys([[0, 1]])
    rope = ops.rope_qk_cache
    bf16_angles = (cos.bfloat16(), sin.bfloat16())
    packed = ops.rows_pack(_rand(16, 64, dtype=torch.float32))
    return [
        ("x must be a CPU tensor, got one on meta", lambda: ops.rms_norm(x.to("meta"), w, 1e-6)),
        ("x must be contiguous", lambda: ops.rms_norm(_rand(64, 3, dtype=torch.float32).t(), w, 1e-6)),
        ("rms_norm: w has 32 values, 64 expected", lambda: ops.rms_norm(x, torch.ones(32), 1e-6)),
        ("rms_norm: w must be Float, got BFloat16", lambda: ops.rms_norm(x, w.bfloat16(), 1e-6)),
        ("add_rms_norm: w must be a CPU tensor", lambda: ops.add_rms_norm(x, x, w.to("meta"), 1e-6)),
        ("x must be float32 or bfloat16, got Half", lambda: ops.rms_norm(x.half(), w, 1e-6)),
        ("silu_mul: gate_up must hold gate then up", lambda: ops.silu_mul(_rand(3, 63, dtype=torch.float32))),
        (
            "rope_qk_cache: cos and sin must be [3 rows",
            lambda: rope(qkv, None, None, 1e-6, cos[:2], sin, cache, cache, 0, heads, kv_heads),
        ),
        (
            "rope_qk_cache: the caches must be Float or float16, got BFloat16",
            lambda: rope(qkv, None, None, 1e-6, cos, sin, cache.bfloat16(), cache, 0, heads, kv_heads),
        ),
        (
            "rope_qk_cache: v_cache must be Half",
            lambda: rope(qkv, None, None, 1e-6, cos, sin, cache.half(), cache, 0, heads, kv_heads),
        ),
        (
            "rope_qk_cache: the caches must be BFloat16, got Half",
            lambda: rope(qkv.bfloat16(), None, None, 1e-6, *bf16_angles, cache.half(), cache.half(), 0, heads, 1),
        ),
        (
            "rope_qk_cache: the caches must be [1 kv heads",
            lambda: rope(qkv, None, None, 1e-6, cos, sin, cache, cache[:, :4].contiguous(), 0, heads, kv_heads),
        ),
        (
            "rope_qk_cache: v_cache must be a CPU tensor",
            lambda: rope(qkv, None, None, 1e-6, cos, sin, cache, cache.to("meta"), 0, heads, kv_heads),
        ),
        ("rope_qk_cache: start -1", lambda: rope(qkv, None, None, 1e-6, cos, sin, cache, cache, -1, heads, kv_heads)),
        (
            "rope_qk_cache: q_norm has 8 values, 16 expected",
            lambda: rope(qkv, torch.ones(8), None, 1e-6, cos, sin, cache, cache, 0, heads, kv_heads),
        ),
        (
            "attention: q must be Float, got BFloat16",
            lambda: ops.attention(q.bfloat16(), cache, cache, keys, spans, 0.2),
        ),
        ("attention: keys must be Long, got Int", lambda: ops.attention(q, cache, cache, keys.int(), spans, 0.2)),
        (
            "attention: k_cache must be a CPU tensor",
            lambda: ops.attention(q, cache.to("meta"), cache, keys, spans, 0.2),
        ),
        (
            "attention: q [2, 1, 8], k_cache",
            lambda: ops.attention(q[..., :8].contiguous(), cache, cache, keys, spans, 0.2),
        ),
        (
            "attention: spans must be contiguous",
            lambda: ops.attention(q, cache, cache, keys, torch.zeros(2, 2, dtype=torch.long).t(), 0.2),
        ),
        ("rows_linear: x must be a CPU tensor", lambda: ops.rows_linear(x.to("meta"), packed, None)),
        ("rows_linear: packed must be a CPU tensor", lambda: ops.rows_linear(x, packed.to("meta"), None)),
        ("rows_pack: the weight must be a CPU tensor", lambda: ops.rows_pack(torch.zeros(16, 64, device="meta"))),
        ("tile_pack: the weight must be a CPU tensor", lambda: ops.tile_pack(torch.zeros(16, 64, device="meta"))),
    ]


def test_every_entry_point_refuses_a_tensor_it_cannot_read_with_a_clear_error(ops):
    """A CUDA (here: meta) tensor, a view, a wrong dtype or extent: one RuntimeError naming the op and argument,
    never a crash or a read of the wrong memory."""
    for message, call in _bad_calls(ops):
        with pytest.raises(RuntimeError) as info:
            call()
        assert message in str(info.value).splitlines()[0], (message, str(info.value)[:300])
