"""What a prefill costs by prompt length, through the native ops and through the PyTorch path's flash attention.

`LeanTarget` prefills prompts of up to `lean.NATIVE_PREFILL_MAX` tokens through the native layer loop, whose rows
are bit for bit what every later forward computes (so a later prompt sharing the prefix may reuse them,
`prefix_reuse`), and longer ones through the PyTorch path (transformers' ``sdpa``, flash attention on the CPU),
whose rows are not reusable. This times one prefill of a synthetic prompt of each ``--lengths`` length both ways
(the limit patched so that both run at every length), the two taking turns, median of ``--reps``, and prints the
ratio: where the native path is no dearer, the limit can sit above that length.

    python bench/bench_prefill.py --dtype bfloat16 --threads 2 --lengths 256,512,1024,1536,2048
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lattice_inference.cli import quiet_transformers
from lattice_inference.models.load import load_model
from lattice_inference.targets import LeanTarget, lean, make_target
from lattice_inference.targets.base import TargetSequence


def prefill_seconds(target: LeanTarget, seq: TargetSequence, prompt: list[int], native: bool) -> float:
    """One cold prefill of ``prompt`` into ``seq`` (the target reuses no rows: ``prefix_cache=False``), natively
    (limit lifted past it) or through the PyTorch path (limit 0)."""
    saved = lean.NATIVE_PREFILL_MAX
    lean.NATIVE_PREFILL_MAX = len(prompt) if native else 0
    try:
        start = time.perf_counter()
        target.prefill(seq, prompt)
        return time.perf_counter() - start
    finally:
        lean.NATIVE_PREFILL_MAX = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="as `lattice bench --model` (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", default="256,512,1024,1536,2048")
    parser.add_argument("--reps", type=int, default=3, help="prefills per length and path (median kept)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    loaded = load_model(args.model, dtype=args.dtype)
    target = make_target(loaded.model, prefix_cache=False)
    if not isinstance(target, LeanTarget) or not target.native:
        raise SystemExit("this model or machine does not run the lean forward's native ops")
    seq = target.new_sequence()
    generator = torch.Generator().manual_seed(0)
    vocab = loaded.model.config.vocab_size
    print(f"{'tokens':>7} {'native ms':>10} {'flash ms':>9} {'native/flash':>13}")
    for length in (int(v) for v in args.lengths.split(",")):
        prompt = torch.randint(0, vocab, (length,), generator=generator).tolist()
        times: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(args.reps + 1):
            for native in (True, False):
                seconds = prefill_seconds(target, seq, prompt, native)
                if rep:  # the first round warms up
                    times[native].append(seconds)
        nat, flash = (statistics.median(times[k]) * 1000 for k in (True, False))
        print(f"{length:>7} {nat:>10.1f} {flash:>9.1f} {nat / flash:>12.2f}x", flush=True)


if __name__ == "__main__":
    main()
