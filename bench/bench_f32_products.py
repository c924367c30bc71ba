"""Float32 requests with the products on our row kernel (``csrc/rows_linear.cpp``) against oneDNN's, side by side.

Float32 is the dtype to run on CPUs without native bfloat16 (AVX2-only) and the one some users pick for accuracy.
Its linear layers run on our row products where the native ops are built (AVX512F or AVX2 with FMA), else on
oneDNN's packed ones (``LATTICE_ROWS=0``). This loads the model twice, one copy packed each way, and sends the same
prompts to both, greedy and ``ngram``, the four taking turns prompt by prompt: decode tokens/s, prefill and whole
request seconds, medians over the prompts; whether each kernel's ``ngram`` output is its own greedy output (lossless)
and how many outputs the two kernels share (they round differently, so near-ties may go either way).

    python bench/bench_f32_products.py --threads 2 --per-kind 2 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from lattice_inference.api import Generator
from lattice_inference.benchmark import default_prompts_path, encode_prompt, first_per_kind, load_prompts
from lattice_inference.cli import quiet_transformers
from lattice_inference.kernels import native_ops
from lattice_inference.models.load import load_model
from lattice_inference.models.source import resolve_model
from lattice_inference.options import DecodeOptions
from lattice_inference.targets import make_target

METHODS = ("greedy", "ngram")


def generators(model: str, rows: bool, prefix_cache: bool) -> dict[str, Generator]:
    """Greedy and ngram generators sharing one float32 target whose products are packed for our row kernel
    (``rows``) or for oneDNN's (whose rows a prefill never reuses)."""
    saved = os.environ.get("LATTICE_ROWS")
    os.environ["LATTICE_ROWS"] = "1" if rows else "0"
    try:
        loaded = load_model(model, dtype="float32")
        target = make_target(loaded.model, prefix_cache=prefix_cache)
    finally:
        if saved is None:
            del os.environ["LATTICE_ROWS"]
        else:
            os.environ["LATTICE_ROWS"] = saved
    return {
        m: Generator(loaded.model, loaded.tokenizer, DecodeOptions(method=m), eos_token_ids=loaded.eos_token_ids,
                     target=target)
        for m in METHODS
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--per-kind", type=int, default=2, help="prompts of each kind in the task set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="cold prefills only (by default a prompt sent to the second method reuses the first's rows where our "
        "products ran: what a user gets, but not a cold prefill's cost)",
    )
    args = parser.parse_args()
    quiet_transformers()
    if args.threads:
        torch.set_num_threads(args.threads)
    if native_ops.rows() is None:
        raise SystemExit(f"our float32 products do not run here ({native_ops.unavailable() or 'no AVX2 with FMA'})")
    cache = not args.no_prefix_cache
    kernels = {"rows": generators(args.model, True, cache), "onednn": generators(args.model, False, cache)}
    prompts = first_per_kind(load_prompts(default_prompts_path(resolve_model(args.model))), args.per_kind)
    stats: dict[tuple[str, str], dict[str, list[float]]] = {
        (k, m): {"tok/s": [], "prefill s": [], "request s": []} for k in kernels for m in METHODS
    }
    outputs: dict[tuple[str, str], list[list[int]]] = {key: [] for key in stats}
    for gens in kernels.values():  # warm-up: self-check, calibration, first shapes
        for gen in gens.values():
            gen.generate(encode_prompt(gen.codec, prompts[0]), max_new_tokens=8)
    turns = [(k, m) for k in kernels for m in METHODS]
    for n, prompt in enumerate(prompts):
        for kernel, method in turns[n % len(turns) :] + turns[: n % len(turns)]:
            gen = kernels[kernel][method]
            out = gen.generate(encode_prompt(gen.codec, prompt), max_new_tokens=args.max_new_tokens)
            m = out.metrics
            s = stats[(kernel, method)]
            s["tok/s"].append(m.new_tokens / m.decode_s if m.decode_s else 0.0)
            s["prefill s"].append(m.prefill_s)
            s["request s"].append(m.prefill_s + m.decode_s)
            outputs[(kernel, method)].append(out.token_ids)
        print(f"[bench] prompt {n + 1}/{len(prompts)}", flush=True)
    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, float32, {torch.get_num_threads()} threads, "
          f"our kernel: {native_ops.product_kernel(torch.float32)}; medians over prompts")  # fmt: skip
    print(f"{'kernel':<8} {'method':<7} {'tok/s':>8} {'prefill s':>10} {'request s':>10} {'= own greedy':>13}")
    for (kernel, method), s in stats.items():
        same = sum(a == b for a, b in zip(outputs[(kernel, method)], outputs[(kernel, "greedy")], strict=True))
        print(
            f"{kernel:<8} {method:<7} {statistics.median(s['tok/s']):>8.1f} {statistics.median(s['prefill s']):>10.3f} "
            f"{statistics.median(s['request s']):>10.3f} {same:>7}/{len(prompts)}"
        )
    for method in METHODS:
        ratio = statistics.median(
            a / b for a, b in zip(stats[("rows", method)]["tok/s"], stats[("onednn", method)]["tok/s"], strict=True)
        )
        shared = sum(a == b for a, b in zip(outputs[("rows", method)], outputs[("onednn", method)], strict=True))
        print(f"{method}: rows / oneDNN decode tok/s, median of per-prompt ratios {ratio:.2f}x; "
              f"outputs the kernels share {shared}/{len(prompts)}")  # fmt: skip


if __name__ == "__main__":
    main()
