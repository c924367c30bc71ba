"""Block attention (`targets/block_attention.py`): every query row computed bit for bit as a 1-token step computes
it, at any width, over chains and draft trees; and it is attention (a float64 reference agrees)."""

from __future__ import annotations

import math

import pytest
import torch

from lattice_inference.targets.block_attention import SLOTS, block_attention, plan_blocks

CPU = torch.device("cpu")
HEADS, KV_HEADS, DIM = 6, 2, 32


def _buffers(capacity: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, KV_HEADS, capacity, DIM, generator=g).to(dtype),
        torch.randn(1, KV_HEADS, capacity, DIM, generator=g).to(dtype),
    )


def _queries(n: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(1, HEADS, n, DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _attend(q, keys, values, start, visible=None):
    seen = None if visible is None else [[c - start for c in cols if c >= start] for cols in visible]
    blocks = plan_blocks(start, q.shape[2], seen, HEADS // KV_HEADS, CPU)
    reach = max(b.reach for b in blocks)
    return block_attention(q, keys[:, :, :reach], values[:, :, :reach], blocks, 1 / math.sqrt(DIM))


def _reference(q, keys, values, visible):
    """float64 softmax attention of each row over its visible key columns."""
    group = HEADS // KV_HEADS
    out = []
    for i, cols in enumerate(visible):
        k = keys[0, :, cols].double().repeat_interleave(group, 0)
        v = values[0, :, cols].double().repeat_interleave(group, 0)
        s = (q[0, :, i : i + 1].double() @ k.transpose(1, 2)) / math.sqrt(DIM)
        out.append((s.softmax(-1) @ v).transpose(0, 1).reshape(1, -1))
    return torch.cat(out)[None]


def test_plan_groups_a_chain_by_position_and_slots_rows_by_position() -> None:
    blocks = plan_blocks(30, 7, None, 3, CPU)  # positions 30..36: blocks 7 (30, 31) and 8 (32..35) and 9 (36)
    assert [b.length for b in blocks] == [32, 36, 40]
    assert [(b.rows, b.slots) for b in blocks] == [
        (slice(0, 2), slice(2, 4)),
        (slice(2, 6), slice(0, 4)),
        (slice(6, 7), slice(0, 1)),
    ]
    assert all(isinstance(b.keys, slice) and b.reach == b.length for b in blocks)
    bias = blocks[0].bias[0, :SLOTS]  # first query head group: slot 2 (position 30) sees keys 0..30
    assert torch.isinf(bias[2, 31]) and bias[2, 30] == 0 and bias[3, 31] == 0
    assert bias[0, 0] == 0 and torch.isinf(bias[0, 1:]).all()  # an unused slot sees key 0 only


def test_plan_gives_a_tree_one_key_sequence_per_path() -> None:
    cached = 10
    parents = [-1, 0, 1, 0]  # rows 0-1-2 a chain, row 3 a sibling of row 1
    seen: list[list[int]] = []
    for i, parent in enumerate(parents):
        seen.append((seen[parent] if parent >= 0 else []) + [i])
    blocks = plan_blocks(cached, 4, seen, 3, CPU)
    rows = sorted(int(r) for b in blocks for r in torch.arange(4)[b.rows].tolist())
    assert rows == [0, 1, 2, 3]
    sibling = next(b for b in blocks if 3 in torch.arange(4)[b.rows].tolist())
    assert isinstance(sibling.keys, torch.Tensor) and sibling.keys[: cached + 2].tolist() == [*range(cached), 10, 13]
    assert sibling.reach == 14


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start", [1, 5, 62, 300, 701])
def test_every_row_of_a_chain_equals_its_one_token_step_bitwise(dtype, start) -> None:
    keys, values = _buffers(start + 40, dtype)
    q = _queries(16, dtype)
    steps = torch.cat([_attend(q[:, :, i : i + 1], keys, values, start + i) for i in range(16)], dim=1)
    for width in range(2, 17):
        assert torch.equal(_attend(q[:, :, :width], keys, values, start), steps[:, :width]), width
    # stale rows past a row's position (a rolled-back draft) change nothing
    stale_keys, stale_values = keys.clone(), values.clone()
    stale_keys[:, :, start + 1 :] *= -3
    stale_values[:, :, start + 1 :] += 7
    assert torch.equal(_attend(q[:, :, :1], stale_keys, stale_values, start), steps[:, :1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_rows_equal_the_steps_along_their_path(dtype) -> None:
    cached, parents = 45, [-1, 0, 1, 2, 0, 1, 4, 3]
    keys, values = _buffers(cached + 40, dtype)
    q = _queries(len(parents), dtype)
    visible: list[list[int]] = []
    for i, parent in enumerate(parents):
        visible.append((visible[parent] if parent >= 0 else list(range(cached))) + [cached + i])
    tree = _attend(q, keys, values, cached, visible)
    for i, cols in enumerate(visible):
        # the step at this row's position: its path's keys laid out in position order, as a kept path would be
        path_k, path_v = keys.clone(), values.clone()
        path_k[:, :, : len(cols)], path_v[:, :, : len(cols)] = keys[:, :, cols], values[:, :, cols]
        step = _attend(q[:, :, i : i + 1], path_k, path_v, len(cols) - 1)
        assert torch.equal(tree[:, i : i + 1], step), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_it_is_attention(dtype) -> None:
    start, n = 37, 9
    keys, values = _buffers(start + n + 8, dtype)
    q = _queries(n, dtype)
    want = _reference(q, keys, values, [list(range(start + i + 1)) for i in range(n)])
    got = _attend(q, keys, values, start)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and torch.allclose(got.double(), want, atol=tolerance, rtol=tolerance)
