"""What a user's first request costs: the target's self-check and cost calibration at the request, or at load.

Each mode runs in a fresh process (the row plans of the linear layers are calibrated once per process), loads the
model, builds a prompt-lookup generator, optionally calls ``Generator.prepare()`` (what ``lattice generate`` and
``lattice serve`` do at load now), then times a first and a second request of ``--max-new-tokens`` tokens on a
grounded prompt.

    python bench/bench_first_request.py --dtype bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def one(mode: str, dtype: str, threads: int, tokens: int) -> dict[str, float]:
    """Run in this process: load, (prepare,) two requests; seconds of each part."""
    import torch

    from lattice_inference import Generator
    from lattice_inference.benchmark import GROUNDED_TASKS, encode_prompt, load_prompts
    from lattice_inference.cli import quiet_transformers

    torch.set_num_threads(threads)
    quiet_transformers()
    start = time.perf_counter()
    gen = Generator.from_pretrained("smollm2", dtype=dtype, method="ngram")
    loaded = time.perf_counter() - start
    start = time.perf_counter()
    if mode == "load":
        gen.prepare()
    prepared = time.perf_counter() - start
    ids = encode_prompt(gen, load_prompts(GROUNDED_TASKS)[0])
    times = []
    for _ in range(2):
        start = time.perf_counter()
        gen.generate(ids, tokens)
        times.append(time.perf_counter() - start)
    return {"load_s": loaded, "prepare_s": prepared, "first_request_s": times[0], "second_request_s": times[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--child", choices=("lazy", "load"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one(args.child, args.dtype, args.threads, args.max_new_tokens)))
        return
    print("command: python " + " ".join(sys.argv))
    print(f"{'mode':<28}{'load s':>8}{'prepare s':>11}{'1st request s':>15}{'2nd request s':>15}")
    for mode, label in (("lazy", "at the first request"), ("load", "at load (prepare)")):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                mode,
                "--dtype",
                args.dtype,
                "--threads",
                str(args.threads),
                "--max-new-tokens",
                str(args.max_new_tokens),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{label:<28}{r['load_s']:>8.2f}{r['prepare_s']:>11.2f}{r['first_request_s']:>15.2f}"
            f"{r['second_request_s']:>15.2f}"
        )


if __name__ == "__main__":
    main()
