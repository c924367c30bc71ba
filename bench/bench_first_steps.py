"""What the first decode steps after a load cost, against the steady step: plain decoding (greedy) of one prompt
right after `Generator.from_pretrained`, then again on the warm generator (another prompt, so no rows are reused).

Prints the load time, each run's first token (the prefill) and mean step times over steps 1-16, 17-64, 65-128 and
129-255, and the first five steps. A first run whose early steps cost more than the later ones pays for something
the load left to the first request (issue 68: the output layer's row plan was calibrated on the first step).

    python bench/bench_first_steps.py --model qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lattice_inference.api import Generator
from lattice_inference.cli import quiet_transformers

PROMPTS = (
    "Write a long story about a lighthouse keeper and the sea.",
    "Write a long story about a clockmaker and a stolen watch.",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="as `lattice generate --model` (default: SmolLM2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    start = time.perf_counter()
    gen = Generator.from_pretrained(args.model, method="greedy")
    gen.prepare()
    print(f"load {time.perf_counter() - start:.1f} s", flush=True)
    for run, prompt in enumerate(PROMPTS):
        generation = gen.start(gen.encode(prompt, chat=gen.has_chat_template), args.tokens)
        times, last = [], time.perf_counter()
        for _chunk in generation:
            now = time.perf_counter()
            times.append(now - last)
            last = now
        steps = times[1:]
        spans = ((0, 16), (16, 64), (64, 128), (128, len(steps)))
        means = ", ".join(f"{a + 1}-{b}: {1000 * statistics.mean(steps[a:b]):.1f}" for a, b in spans if steps[a:b])
        first = [round(1000 * s, 1) for s in steps[:5]]
        print(f"run {run}: first token {1000 * times[0]:.0f} ms; mean step ms {means}; first five {first}", flush=True)


if __name__ == "__main__":
    main()
