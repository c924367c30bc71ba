"""Attention whose every query row is computed the same way at any width: fixed-shape blocks over the cache.

Why: a lossless verification must score row ``i`` of a k-token forward bit for bit as the 1-token step at that
position would. Attention kernels change their reduction order with the number of query rows and of keys, so
the decode-matched fallback (`decode_matched.decode_matched_sdpa`) runs one attention call per row: exact, but a
16-token verification then costs 16 attention calls per layer, which on a small model doubles its forward.

How: a row at position ``p`` is always computed in a block of `SLOTS` query rows, in slot ``p % SLOTS``, against
the first ``(p // SLOTS + 1) * SLOTS`` keys of its key sequence (the keys it may see, in position order: the
cache for a chain, the cache and its ancestors for a draft tree), those past ``p`` masked out; scores, softmax and
the value product run in float32 (``[kv_heads, groups * SLOTS, ...]`` batched products). Every shape a row meets
depends on its position only, never on how many rows came with it, so a 1-token step and row ``i`` of any
verification run the same kernels on the same operands: the other slots hold other rows (or zeros), and a masked
key contributes an exact zero (its score is overwritten with -inf, its probability is 0, its value finite). Rows of
one forward share a block where their positions share ``p // SLOTS`` and their key sequences are prefixes of one
path: a chain of up to 16 tokens takes one or two blocks per layer, a draft tree one per path.

The buffer past the cache's length must hold finite values (stale rows from a rollback, or zeros:
`kv_cache.GrowableLayer` allocates zeroed buffers). `check_exactness` verifies the result bitwise at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SLOTS = 4
"""Query rows per block, and the granularity of a block's key count. Fewer slots make the 1-token step cheaper
(it pays for ``SLOTS`` rows) and a wide verification dearer (``k / SLOTS`` blocks); 4 balances the two on a
2-core CPU (timings: bench/RESULTS.md)."""


@dataclass(frozen=True)
class Block:
    """Rows of one forward computed together (see the module docstring)."""

    rows: slice | torch.Tensor
    """The forward's rows in this block (a slice where consecutive)."""
    slots: slice | torch.Tensor
    """Each row's slot, its position modulo `SLOTS` (a slice where consecutive)."""
    keys: slice | torch.Tensor
    """Cache rows forming the block's key sequence, ``length`` of them: a slice for a contiguous one."""
    length: int
    """Keys each row's scores run over."""
    bias: torch.Tensor
    """``[1, groups * SLOTS, length]`` float32, added to the scores: -inf where a slot's row may not see that key
    (unused slots see key 0 only), else 0."""
    reach: int
    """Cache buffer rows the block reads: its highest key row + 1."""


def plan_blocks(start: int, rows: int, seen: list[list[int]] | None, groups: int, device: torch.device) -> list[Block]:
    """The blocks of a forward of ``rows`` tokens written at cache rows ``start..``, every row seeing the whole cache
    before them: a chain (``seen`` None, row ``i`` at position ``start + i``), or a draft tree where row ``i`` also
    sees the new rows ``seen[i]`` (its ancestors and itself, in increasing order) and sits at position
    ``start + len(seen[i]) - 1``. ``groups``: query heads per key-value head."""
    if seen is None:
        paths: list[tuple[list[int], list[int], list[int] | None]] = [
            (list(range(rows)), [start + i for i in range(rows)], None)
        ]
    else:
        paths = [(members, [start + len(seen[r]) - 1 for r in members], path) for members, path in _paths(seen)]
    blocks = []
    for members, positions, path in paths:
        by_block: dict[int, list[tuple[int, int]]] = {}
        for row, position in zip(members, positions, strict=True):
            by_block.setdefault(position // SLOTS, []).append((row, position))
        for index, group in sorted(by_block.items()):
            blocks.append(_block(group, start, path, (index + 1) * SLOTS, groups, device))
    return blocks


def _paths(seen: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """Rows grouped by a common path of new rows: each group's rows see prefixes of its deepest row's path."""
    order = sorted(range(len(seen)), key=lambda r: -len(seen[r]))
    left, paths = set(order), []
    for row in order:
        if row not in left:
            continue
        path = seen[row]
        members = [r for r in order if r in left and seen[r] == path[: len(seen[r])]]
        left.difference_update(members)
        paths.append((members, path))
    return paths


def _block(
    group: list[tuple[int, int]],
    start: int,
    path: list[int] | None,
    length: int,
    groups: int,
    device: torch.device,
) -> Block:
    """One block of ``group`` (rows and their positions) over the first ``length`` keys of the cache followed by
    the new rows of ``path`` (None, or a path that is the new rows in order: the cache's own order, a slice)."""
    keys: slice | torch.Tensor = slice(0, length)
    reach = length
    if path is not None and path != list(range(len(path))):  # not the cache's own order: gather the keys
        sequence = torch.cat([torch.arange(start), torch.tensor(path, dtype=torch.long) + start])[:length]
        padded = torch.cat([sequence, sequence.new_zeros(length - len(sequence))])  # masked: any finite key serves
        keys, reach = padded.to(device), int(padded.max()) + 1
    bias = torch.full((SLOTS, length), float("-inf"))
    bias[:, 0] = 0.0
    slots = [position % SLOTS for _, position in group]
    for slot, (_, position) in zip(slots, group, strict=True):
        bias[slot, : position + 1] = 0.0
    return Block(
        rows=_index([row for row, _ in group], device),
        slots=_index(slots, device),
        keys=keys,
        length=length,
        bias=bias.repeat(groups, 1)[None].to(device),
        reach=reach,
    )


def _index(values: list[int], device: torch.device) -> slice | torch.Tensor:
    """``values`` as an index: a slice where they are consecutive and increasing (a view, no gather)."""
    if values == list(range(values[0], values[0] + len(values))):
        return slice(values[0], values[0] + len(values))
    return torch.tensor(values, device=device)


def block_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: list[Block], scaling: float
) -> torch.Tensor:
    """Attention of ``query`` (``[1, heads, n, dim]``, rotary applied) over ``keys``/``values`` (``[1, kv_heads,
    capacity, dim]``: the cache buffer, at least as long as every block's keys) by `plan_blocks`' ``blocks``;
    returns ``[1, n, heads * dim]`` in the query's dtype."""
    _, heads, n, dim = query.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    q = query[0].view(kv_heads, groups, n, dim)
    out = query.new_empty(kv_heads, groups, n, dim)
    for block in blocks:
        qb = torch.zeros(kv_heads, groups, SLOTS, dim, dtype=torch.float32, device=query.device)
        qb[:, :, block.slots] = q[:, :, block.rows].float()
        k = keys[0][:, block.keys].float()
        v = values[0][:, block.keys].float()
        scores = torch.baddbmm(block.bias, qb.view(kv_heads, groups * SLOTS, dim), k.transpose(1, 2), alpha=scaling)
        probs = torch.softmax(scores, dim=-1)
        rows = torch.matmul(probs, v).view(kv_heads, groups, SLOTS, dim)[:, :, block.slots]
        out[:, :, block.rows] = rows.to(query.dtype)
    return out.view(heads, n, dim).transpose(0, 1).reshape(1, n, heads * dim)
