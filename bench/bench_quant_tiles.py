"""Quantized products on AMX tiles against the vector dots (``csrc/quant_linear.cpp``), side by side, by rows.

Where the CPU grants AMX, products of the 32-input GGUF formats take their exact integer dots from tile products from
some rows on (Q8_0 from 5, Q4_0/Q4_1/Q5_0/Q5_1 from 32); below, and with ``LATTICE_AMX=0``, from AVX-512 VNNI
dot products. The sums are the same bits either way (``tests/test_quant_linear.py``); this measures what each costs.
One "forward" is the products of a SmolLM2-135M-shaped decoder: 30 layers, each with its own copy of the weights so
that they stream from memory as in a real forward (q/k/v 960 x 576, o 576 x 576, gate/up 3072 x 576, down 576 x
1536), then the 49,152 x 576 Q8_0 output layer (the default model's tied head). For each format and row count, the
two kernels take turns (`prefer_amx`) repetition by repetition; medians in ms, the layers and the head apart. A row
is printed as soon as it is measured.

    python bench/bench_quant_tiles.py --threads 2 --formats Q8_0,Q5_0,Q4_1 --rows 8,16,32,64,114 --reps 10
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_serve_concurrency import cpu_line

from lattice_inference.kernels import native_ops
from lattice_inference.kernels.quant_linear import quant_pack
from lattice_testing.gguf_blocks import quantize

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
"""A SmolLM2-135M layer's products (fused q/k/v, o, fused gate/up, down): outputs, inputs."""
LAYERS = 30
HEAD = (49152, 576)


def packed(kind: str, out: int, inp: int, seed: int) -> torch.Tensor:
    """A random ``[out, inp]`` weight as ``kind`` blocks in `quant_pack`'s layout."""
    weight = torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)) * 0.05
    return quant_pack(quantize(weight, kind), kind)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", default="Q8_0,Q5_0,Q4_1")
    ap.add_argument("--rows", default="1,4,8,16,32,64,114")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = native_ops.quant()
    if ops is None or not ops.quant_linear_tiles():
        raise SystemExit(f"no quantized AMX tiles here (kernel {native_ops.quant_kernel()}; LATTICE_AMX=0?)")
    print(cpu_line(), f"{args.threads} threads;", native_ops.quant_kernel())
    head = packed("Q8_0", *HEAD, seed=99)
    print("| format | rows | tiles: layers / head ms | vector: layers / head ms | layers ratio |")
    print("|---|---|---|---|---|")
    for kind in args.formats.split(","):
        base = [packed(kind, out, inp, seed=i) for i, (out, inp) in enumerate(SHAPES)]
        layers = [[w.clone() for w in base] for _ in range(LAYERS)]
        for n in (int(r) for r in args.rows.split(",")):
            narrow, wide = torch.randn(n, 576), torch.randn(n, 1536)
            times: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
            try:
                for rep in range(args.reps + 1):
                    for tiles in (True, False):
                        ops.prefer_amx(tiles)
                        start = time.perf_counter()
                        for qkv, o, gate_up, down in layers:
                            for w in (qkv, o, gate_up):
                                ops.quant_linear(narrow, w, None)
                            ops.quant_linear(wide, down, None)
                        middle = time.perf_counter()
                        ops.quant_linear(narrow, head, None)
                        end = time.perf_counter()
                        if rep:  # the first repetition warms up
                            times[tiles][0].append(middle - start)
                            times[tiles][1].append(end - middle)
            finally:
                ops.prefer_amx(True)
            ms = {k: [statistics.median(v) * 1e3 for v in pair] for k, pair in times.items()}
            print(f"| {kind} | {n} | {ms[True][0]:.2f} / {ms[True][1]:.2f} | {ms[False][0]:.2f} / {ms[False][1]:.2f} "
                  f"| {ms[False][0] / ms[True][0]:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
