"""What a prefill costs by prompt length, through the native ops and through the PyTorch path's flash attention.

`LeanTarget` prefills every prompt through the native layer loop, whose rows are bit for bit what every later
forward computes (so a later prompt sharing the prefix may reuse them, `prefix_reuse`, and a long prompt may be
taken in by chunks beside other streams); before, prompts past 4096 tokens went through the PyTorch path
(transformers' ``sdpa``, flash attention on the CPU), whose rows are not reusable. This times one cold prefill of a
synthetic prompt of each ``--lengths`` length both ways (the second a target built with ``native=False``, the
PyTorch path's prefill), the two taking turns, median of ``--reps``, and prints the ratio.

    python bench/bench_prefill.py --model FILE.gguf --threads 2 --lengths 4096,8192,12288 --reps 1 --warmup 0
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lattice_inference.cli import quiet_transformers
from lattice_inference.models.load import load_model
from lattice_inference.targets import LeanTarget, make_target


def prefill_seconds(target: LeanTarget, prompt: list[int]) -> float:
    """One cold prefill of ``prompt`` on a new sequence of ``target`` (which reuses no rows), released after."""
    seq = target.new_sequence()
    start = time.perf_counter()
    target.prefill(seq, prompt)
    seconds = time.perf_counter() - start
    target.release(seq)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="as `lattice bench --model` (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", default="256,512,1024,1536,2048")
    parser.add_argument("--reps", type=int, default=3, help="prefills per length and path (median kept)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    loaded = load_model(args.model, dtype=args.dtype)
    native = make_target(loaded.model, prefix_cache=False)
    if not isinstance(native, LeanTarget) or not native.native:
        raise SystemExit("this model or machine does not run the lean forward's native ops")
    flash = LeanTarget(loaded.model, native=False, prefix_cache=False)
    generator = torch.Generator().manual_seed(0)
    vocab = loaded.model.config.vocab_size
    print(f"{'tokens':>7} {'native ms':>10} {'flash ms':>9} {'native/flash':>13}")
    for length in (int(v) for v in args.lengths.split(",")):
        prompt = torch.randint(0, vocab, (length,), generator=generator).tolist()
        times: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(args.warmup + args.reps):
            for which in (True, False):
                seconds = prefill_seconds(native if which else flash, prompt)
                if rep >= args.warmup:
                    times[which].append(seconds)
        nat, fl = (statistics.median(times[k]) * 1000 for k in (True, False))
        print(f"{length:>7} {nat:>10.1f} {fl:>9.1f} {nat / fl:>12.2f}x", flush=True)


if __name__ == "__main__":
    main()
