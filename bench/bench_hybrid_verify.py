"""Cost of verifying k draft tokens on a hybrid (Gated DeltaNet + attention) model, as a multiple of one decode step.

Model: random-weight Qwen3.5-0.8B-shaped text model in ``--dtype`` (hidden 1024, 24 layers = 18 Gated DeltaNet +
6 full attention, 8 query / 2 KV heads of 256, delta-net 16 key / 16 value heads of 128, intermediate 3584,
vocab 248320, tied embeddings), prompt of ``--prompt`` random tokens, ``torch.set_num_threads(2)``.

Measured, interleaved round-robin so that host noise hits every column alike (median of ``--reps`` rounds after
one warm-up round):

* ``step``: one plain transformers decode step (1 token, ordinary ``DynamicCache``: fused conv update and the
  recurrent kernel), the unit of every ratio;
* ``hybrid k``: `HybridTarget.forward` (GDN kernel ``--kernel``, default ``window``) of k tokens (logits for
  all k) plus ``rollback(start + 1)``, i.e. every draft rejected (rebuilds the recurrent state after position 0,
  crops KV and conv; any accepted length costs about the same);
* ``hf k``: transformers' own path: a k-token forward on a recording cache (chunked delta-rule kernel for k > 1)
  plus ``crop(-(k - 1))``; its recurrent state is then wrong, but this is what it costs.

Ratios: the median over rounds of (column time / the same round's step time), and min time / min step time;
both are steadier than a ratio of medians when other processes share the CPU. Each timed round leaves one more
token in the cache (the accepted one), so the context grows by at most ``reps + 1`` tokens over the run.
Run: ``.venv/bin/python bench/bench_hybrid_verify.py`` (about 1 minute on an idle host, under 3 when shared).
"""

from __future__ import annotations

import argparse
import copy
import shlex
import statistics
import sys
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from lattice_inference.targets.hybrid import KERNELS, HybridTarget
from lattice_testing.toy import qwen35_08b_shape_config

KS = (1, 2, 4, 8, 16)


class PlainDecoder:
    """transformers' ordinary cached decoding, one token per forward (the baseline step).

    ``cache`` is a prefilled copy; with ``recording`` off the GDN layers take the fused conv update and the
    recurrent kernel, as ``generate`` does.
    """

    def __init__(self, model: PreTrainedModel, cache: DynamicCache, length: int, *, recording: bool) -> None:
        self.model = model
        self.cache = cache
        self.length = length
        for layer in cache.layers:
            if hasattr(layer, "record_past"):
                layer.record_past = recording

    def forward(self, ids: list[int]) -> torch.Tensor:
        pos = torch.arange(self.length, self.length + len(ids)).unsqueeze(0)
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids]), position_ids=pos, cache=self.cache, use_cache=True)
        self.length += len(ids)
        return out.logits[0]

    def verify(self, ids: list[int]) -> None:
        """transformers' own speculative path (needs ``recording``): k-token forward, then ``crop``."""
        self.forward(ids)
        self.cache.crop(1 - len(ids))
        self.length -= len(ids) - 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=512, help="prompt length in tokens")
    parser.add_argument("--reps", type=int, default=7, help="timed rounds (median reported)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: CPU time of the calling thread (time.thread_time), meaningful with --threads 1 only; it "
        "excludes time spent waiting for a core, so it is a steadier measure of work on a shared host",
    )
    parser.add_argument("--kernel", choices=KERNELS, default="window", help="HybridTarget's GDN kernel")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weights (float32 by default: CPUs without native bfloat16, like this AVX2 one, run it slower)",
    )
    parser.add_argument("--dense", action="store_true", help="keep the model's own F.linear (no packed weights)")
    args = parser.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures one thread: use it with --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    print("command:", shlex.join([sys.executable, *sys.argv]))

    torch.manual_seed(0)
    t0 = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_config(qwen35_08b_shape_config(), dtype=dtype).eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.0f} M params, {args.dtype}, built in {time.perf_counter() - t0:.1f} s")
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt,)).tolist()

    t0 = time.perf_counter()
    target = HybridTarget(model, kernel=args.kernel, packed_weights=not args.dense)  # the step shares the model
    built_s = time.perf_counter() - t0
    seq = target.new_sequence()  # outside the timed region
    t0 = time.perf_counter()
    target.prefill(seq, prompt)
    prefill_s = built_s + time.perf_counter() - t0
    assert seq.cache is not None
    with torch.inference_mode():  # the same prefilled state for the two transformers baselines
        plain = PlainDecoder(model, copy.deepcopy(seq.cache), len(prompt), recording=False)
        hf = PlainDecoder(model, copy.deepcopy(seq.cache), len(prompt), recording=True)
    print(f"prefill {args.prompt} tokens: {prefill_s:.2f} s ({args.prompt / prefill_s:.0f} tok/s)")

    def plain_step(ids: list[int]) -> None:
        plain.forward(ids)

    def hybrid_verify(ids: list[int]) -> None:
        start = seq.length
        target.forward(seq, ids)
        target.rollback(seq, start + 1)

    columns: list[tuple[str, int, Callable[[list[int]], None]]] = [("step", 1, plain_step)]
    for k in KS:
        columns += [(f"hybrid {k}", k, hybrid_verify), (f"hf {k}", k, hf.verify)]
    times: dict[str, list[float]] = {name: [] for name, _, _ in columns}
    for rep in range(args.reps + 1):
        for name, k, fn in columns:
            ids = torch.randint(0, vocab, (k,)).tolist()
            start = clock()
            fn(ids)
            if rep:  # the first round is a warm-up
                times[name].append(clock() - start)

    med = {name: statistics.median(ts) for name, ts in times.items()}
    low = {name: min(ts) for name, ts in times.items()}
    steps = times["step"]

    def paired(name: str) -> float:
        """Median over rounds of (this column / the plain step of the same round): cancels slow host drift."""
        return statistics.median(t / s for t, s in zip(times[name], steps, strict=True))

    print(
        f"\n{args.reps} rounds, {args.clock} clock, {args.threads} thread(s), HybridTarget kernel {args.kernel!r}; "
        "one plain decode step: "
        f"median {med['step'] * 1e3:.1f} ms, min {low['step'] * 1e3:.1f} ms (ratio 1.00)"
    )
    print("ratio = median over rounds of (time / same round's plain step); min-ratio = min time / min step time")
    print("| k | HybridTarget verify+rollback: median ms | ratio | min-ratio | transformers forward+crop: median ms "
          "| ratio | min-ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for k in KS:
        h, f = f"hybrid {k}", f"hf {k}"
        print(
            f"| {k} | {med[h] * 1e3:.1f} | {paired(h):.2f} | {low[h] / low['step']:.2f} "
            f"| {med[f] * 1e3:.1f} | {paired(f):.2f} | {low[f] / low['step']:.2f} |"
        )


if __name__ == "__main__":
    main()
