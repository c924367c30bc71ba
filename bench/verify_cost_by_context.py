"""What verifying k tokens costs as the context grows, and how much of it is attention.

The draft planner weighs each draft against the target's forward costs, measured once per model after a short
context (`targets/forward_cost.py`, ``CALIBRATION_CONTEXT``) and corrected by the forwards each generation times.
Agentic requests run at hundreds of tokens of context, where every row of a k-token forward attends over the
whole cache: this prints, for each ``--contexts`` length, the cost of a forward of each ``--widths`` width in
1-token forwards (the planner's measurement, taken after that context: fastest of ``--repeats``), and the native
attention alone at that context over 1, 4, 8 and 16 rows, every layer's (`profile_step.lean_parts`, median of
``--reps`` timings).

    python bench/verify_cost_by_context.py --dtype bfloat16 --threads 2
"""

from __future__ import annotations

import argparse

import torch
from profile_step import lean_parts

from lattice_inference.cli import quiet_transformers
from lattice_inference.kernels import native_ops
from lattice_inference.models.load import load_model
from lattice_inference.targets import LeanTarget, make_target
from lattice_inference.targets.forward_cost import measure_forward_costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="as `lattice bench --model` (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", default="64,300,600,900")
    parser.add_argument("--widths", default="1,2,4,8,11,16")
    parser.add_argument("--repeats", type=int, default=5, help="forwards per width and context (fastest kept)")
    parser.add_argument("--reps", type=int, default=15, help="timings of the attention alone (median kept)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    loaded = load_model(args.model, dtype=args.dtype)
    target = make_target(loaded.model)
    widths = [int(w) for w in args.widths.split(",")]
    native = isinstance(target, LeanTarget) and native_ops.ops() is not None
    kernel = native_ops.product_kernel(loaded.model.dtype) or "oneDNN"
    print(f"{type(target).__name__}, {args.dtype}, {args.threads} threads, products on {kernel}")
    head = f"{'context':>8} {'1-token ms':>11}  " + " ".join(f"{w:>6}" for w in widths)
    print("forward of k tokens, in 1-token forwards; then attention alone (ms, all layers)")
    print(head)
    for context in [int(c) for c in args.contexts.split(",")]:
        costs = measure_forward_costs(target, widths, repeats=args.repeats, context=context)
        ratios = " ".join(f"{costs.relative(w):>6.2f}" for w in widths)
        print(f"{context:>8} {costs.measured[0] * 1000:>11.2f}  {ratios}")
        attention = lean_parts(target, context, args.reps).get("attention") if native else None
        if attention:
            cells = " ".join(f"{w}: {ms:.2f}" for w, ms in attention.items())
            print(f"{'':>8} attention alone, ms by rows: {cells}")


if __name__ == "__main__":
    main()
