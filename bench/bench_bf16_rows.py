"""bfloat16 weights on CPUs without bfloat16 dot products: our row kernel from the bfloat16 bytes, side by side with
float32 and with torch's own bfloat16 products, at the sizes people run on CPUs.

On an AVX2-only CPU (or here, held to AVX2: ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``) a bfloat16 model
ran its products in torch's emulated bfloat16 (``F.linear``: oneDNN cannot pack bfloat16 there), padded to row plans;
``csrc/rows_linear.cpp`` now computes them in float32 from the bfloat16 bytes, every row alike at any width (the
native layer loop runs, prompt rows are reusable). This builds the lean target three ways over the same weights and
times them taking turns: ``float32`` (our row products over float32 weights), ``bf16 rows`` (ours over the bfloat16
bytes) and ``bf16 torch`` (the weights unpacked: torch's own ``F.linear`` under row plans, what an AVX2-only CPU
ran before, where oneDNN cannot pack bfloat16; a CPU held to AVX2 could still pack them, so this is forced). For
each: the 1-token step and a 16-token verification after a 256-token context, in ms (median of ``--reps``), and
whether the 16 rows equal 16 1-token steps.
Shapes: SmolLM2-135M (the real weights, ``smollm2``) and SmolLM2-360M / 1.7B shapes with random weights (speed
depends on shapes, not values). Where the CPU has bfloat16 dot products (AVX512_BF16, AMX) ``bf16 rows`` forces
``LATTICE_TILES=0`` to run this path.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/bench_bf16_rows.py --threads 2 --shapes 135m,360m
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from lattice_inference.cli import quiet_transformers
from lattice_inference.cpu_features import has_native_bf16, isa_ceiling
from lattice_inference.kernels import native_ops
from lattice_inference.models.load import load_model
from lattice_inference.targets.base import TargetSequence
from lattice_inference.targets.lean import LeanTarget

SHAPES = {  # SmolLM2 configurations (hidden, intermediate, layers, heads, kv heads)
    "360m": (960, 2560, 32, 15, 5),
    "1.7b": (2048, 8192, 24, 32, 32),
}
CONFIGS = ("float32", "bf16 rows", "bf16 torch")


@contextlib.contextmanager
def env(**values: str) -> Iterator[None]:
    """Set environment variables for the enclosed block (the kernels are chosen when a target packs its weights)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def model_for(shape: str, dtype: torch.dtype) -> PreTrainedModel:
    """SmolLM2-135M's real weights, or a random-weight model of a larger SmolLM2 shape, in ``dtype``."""
    if shape == "135m":
        return load_model("smollm2", dtype=str(dtype).removeprefix("torch.")).model
    hidden, inter, layers, heads, kv = SHAPES[shape]
    config = AutoConfig.for_model(
        "llama", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True,
        rms_norm_eps=1e-5, rope_theta=100000.0,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.eval()


def target_for(model: PreTrainedModel, config: str) -> LeanTarget:
    """The lean target over ``model`` with the products ``config`` names."""
    switches = {"float32": {}, "bf16 rows": {"LATTICE_TILES": "0"}, "bf16 torch": {"LATTICE_ROWS": "0"}}[config]
    with env(**switches):
        return LeanTarget(model, prefix_cache=False, packed_weights=config != "bf16 torch")


def timed(target: LeanTarget, seq: TargetSequence, context: list[int], tokens: list[int]) -> float:
    start = time.perf_counter()
    target.forward(seq, tokens)
    seconds = time.perf_counter() - start
    target.rollback(seq, len(context))
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="135m,360m", help="comma-separated: 135m (real weights), 360m, 1.7b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--json", help="append each shape's rows here as JSON lines, as they are measured")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    cpu = f"isa {isa_ceiling()}, native bf16 {has_native_bf16()}, rows kernel {native_ops.rows_kernel()}"
    print(f"command: python {' '.join(sys.argv)}\n{cpu}, {args.threads} threads", flush=True)
    for shape in args.shapes.split(","):
        f32 = model_for(shape, torch.float32)
        bf16 = model_for(shape, torch.bfloat16)
        targets = {c: target_for(f32 if c == "float32" else bf16, c) for c in CONFIGS}
        seqs = {c: target.new_sequence() for c, target in targets.items()}
        vocab = int(f32.config.vocab_size)
        context = [(7 * i + 3) % vocab for i in range(args.context)]
        draft = [(11 * i + 5) % vocab for i in range(16)]
        times: dict[str, dict[str, list[float]]] = {c: {"step": [], "verify16": []} for c in CONFIGS}
        exact = {}
        for c, target in targets.items():
            seq = seqs[c]
            target.prefill(seq, context)
            wide = target.forward(seq, draft)
            target.rollback(seq, len(context))
            alone = []
            for token in draft:
                alone.append(target.forward(seq, [token])[0])
            target.rollback(seq, len(context))
            exact[c] = all(torch.equal(wide[i], alone[i]) for i in range(16))
            timed(target, seq, context, draft[:1])  # warm
        for _ in range(args.reps):
            for c, target in targets.items():  # taking turns
                times[c]["step"].append(timed(target, seqs[c], context, draft[:1]))
                times[c]["verify16"].append(timed(target, seqs[c], context, draft))
        rows = {}
        for c in CONFIGS:
            step = statistics.median(times[c]["step"]) * 1e3
            verify = statistics.median(times[c]["verify16"]) * 1e3
            rows[c] = {"step_ms": round(step, 2), "verify16_ms": round(verify, 2), "rows_exact": exact[c],
                       "native_loop": targets[c]._loop is not None}  # fmt: skip
        base = rows["float32"]["step_ms"]
        print(f"\n== {shape} ({args.context}-token context, median of {args.reps}) ==", flush=True)
        print(f"{'products':<12} {'step ms':>8} {'vs f32':>7} {'16-token ms':>12} {'= steps':>8} {'16 rows exact':>14}")
        for c, r in rows.items():
            ratio = r["step_ms"] / base
            steps = r["verify16_ms"] / r["step_ms"]
            exact = "yes" if r["rows_exact"] else "no"
            print(f"{c:<12} {r['step_ms']:>8.2f} {ratio:>6.2f}x {r['verify16_ms']:>12.2f} {steps:>8.2f} {exact:>14}")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"shape": shape, "cpu": cpu, "threads": args.threads, "rows": rows}) + "\n")
        del seqs, targets, f32, bf16


if __name__ == "__main__":
    main()
