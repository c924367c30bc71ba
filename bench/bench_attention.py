"""The native attention op (`lean_ops.cpp` ``attend``) against torch's ``scaled_dot_product_attention`` (the flash
path on a CPU), per chunk of prompt rows over a long cache, and one decode row.

For each ``--keys`` length it times ``--rows`` prompt rows attending causally to a cache of that many keys (the
last chunk of a prompt of that length: what a chunked or long prefill runs per layer), both ways, the two taking
turns, median of ``--reps``; then one row over the whole cache (a decode step's attention). Shapes default to
Qwen2.5-0.5B's (14 query heads, 2 key-value heads, head size 64).

    python bench/bench_attention.py --threads 2 --keys 4096,8192,16384,32768
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import ModuleType

import torch

from lattice_inference.kernels import native_ops


def timed(run, reps: int) -> float:
    """Median seconds of ``reps`` calls of ``run`` (after one untimed call)."""
    run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keys", default="4096,8192,16384,32768")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = native_ops.ops()
    if ops is None:
        raise SystemExit(f"the native ops do not run here: {native_ops.unavailable()}")
    print(f"{'keys':>6} {'native ms':>10} {'sdpa ms':>8} {'native/sdpa':>12} {'GMAC/s':>7} {'1-row us':>9}")
    for total in (int(v) for v in args.keys.split(",")):
        measure(ops, total, args)


def causal_chunk(
    heads: int, kv_heads: int, head_dim: int, n: int, total: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The native attention op's operands for the last ``n`` rows of a ``total``-key cache attending causally
    (random queries, keys and values; the key list; each row's span), and the multiply-adds of its scores and value
    sums."""
    start = total - n
    q = torch.randn(heads, n, head_dim)
    k_cache, v_cache = torch.randn(kv_heads, total, head_dim), torch.randn(kv_heads, total, head_dim)
    spans = torch.tensor([[0, start + r + 1] for r in range(n)])
    macs = 2 * heads * head_dim * sum(start + r + 1 for r in range(n))
    return q, k_cache, v_cache, torch.arange(total), spans, macs


def measure(ops: ModuleType, total: int, args: argparse.Namespace) -> None:
    """One ``--keys`` length: a chunk of ``--rows`` rows both ways and one decode row, printed as a table row."""
    h, kv, d, n = args.heads, args.kv_heads, args.head_dim, args.rows
    scale, start = d**-0.5, total - n
    q, k_cache, v_cache, keys, spans, macs = causal_chunk(h, kv, d, n, total)
    k_all, v_all = k_cache[None].repeat_interleave(h // kv, 1), v_cache[None].repeat_interleave(h // kv, 1)
    mask = torch.ones(n, total, dtype=torch.bool).tril(start)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    native_s = timed(lambda: ops.attention(q, k_cache, v_cache, keys, spans, scale), args.reps)
    sdpa_s = timed(lambda: sdpa(q[None], k_all, v_all, attn_mask=mask, scale=scale), args.reps)
    last = q[:, -1:].contiguous()
    one_s = timed(lambda: ops.attention(last, k_cache, v_cache, keys, spans[-1:], scale), 20)
    print(
        f"{total:>6} {native_s * 1e3:>10.1f} {sdpa_s * 1e3:>8.1f} {native_s / sdpa_s:>11.2f}x "
        f"{macs / native_s / 1e9:>7.1f} {one_s * 1e6:>9.0f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
