"""Where one decode step of the real model spends its time, and what verifying k tokens costs, per configuration.

Configurations: ``dense``: the model's own ``F.linear`` and attention over all rows at once; ``packed``: oneDNN-
packed weights with fused q/k/v and gate/up (``kernels/packed_linear.py``), rows at once (``--batched-verify``);
``matched``: packed and decode-matched (``kernels/decode_matched.py``: every row of a k-token forward computed bit
for bit as the 1-token step computes it) through transformers' forward (``--forward transformers``); ``lean``: the
default, the same through the lean decoder loop (``targets/lean.py``). For each it prints:
- the wall time of a forward of 1..16 tokens through our target after a grounded prompt (median of ``--reps``),
  and its ratio to the 1-token step: the cost of verifying a draft;
- whether each row of those forwards equals the 1-token step's (the target's self-check, widths 2..16);
- a breakdown of one 1-token step from ``torch.profiler``: matrix products (the linear layers and the LM head),
  attention, every other op (norms, rotary embedding, activations, cache writes, views), and the rest of the
  unprofiled step time (Python, module dispatch: the 1-token wall time above minus the ops' own time; the
  profiler's own overhead inflates op times a little, so this share is a lower bound);
- the lean forward's products and attention alone at 1/4/8/16 tokens, and its prefill of the prompt through the
  native ops (the default) and through its PyTorch path.

    python bench/profile_step.py --dtype bfloat16 --threads 2
    python bench/profile_step.py --dtype bfloat16 --device cuda   # on a GPU: times synchronised, kernel time profiled
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import timed

from lattice_inference.benchmark import GROUNDED_TASKS, load_prompts
from lattice_inference.cli import quiet_transformers
from lattice_inference.devices import placement
from lattice_inference.kernels import native_ops
from lattice_inference.kernels.packed_linear import packed_linear, packed_operands, quant_inputs, quant_packed
from lattice_inference.models.load import LoadedModel, load_model
from lattice_inference.targets import LeanTarget, TransformersTarget
from lattice_inference.targets.base import TargetSequence
from lattice_inference.targets.exactness import check_exactness

WIDTHS = tuple(range(1, 17))


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a wall-clock interval holds it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise"}
ATTENTION_OPS = {"aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math"}


def step_times(
    targets: dict[str, TransformersTarget], seqs: dict[str, TargetSequence], reps: int
) -> dict[str, dict[int, float]]:
    """Median seconds of a forward of each width per target (on its sequence in ``seqs``), rolled back after each;
    the targets take turns within every repetition so that a slow moment of the host hits them alike."""
    times: dict[str, dict[int, list[float]]] = {name: {w: [] for w in WIDTHS} for name in targets}
    for rep in range(reps + 1):
        for width in WIDTHS:
            for name, target in targets.items():
                seq = seqs[name]
                length = seq.length
                sync(target.device)
                start = time.perf_counter()
                target.forward(seq, [100] * width)
                sync(target.device)
                elapsed = time.perf_counter() - start
                target.rollback(seq, length)
                if rep:  # the first round warms up
                    times[name][width].append(elapsed)
    return {name: {w: statistics.median(ts) for w, ts in by_width.items()} for name, by_width in times.items()}


def breakdown(target: TransformersTarget, seq: TargetSequence, steps: int, wall: float) -> dict[str, float]:
    """Milliseconds per 1-token step of ``seq`` by category (see the module docstring); ``wall``: the unprofiled
    step, ms."""
    length = seq.length
    on_gpu = target.device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            target.forward(seq, [100])
            target.rollback(seq, length)
        sync(target.device)
    cats = {"matrix products": 0.0, "attention": 0.0, "other ops": 0.0}
    for event in prof.key_averages():  # on a GPU: the kernels' own time; on a CPU: the ops' own time
        own = event.self_device_time_total if on_gpu else event.self_cpu_time_total
        ms = own / 1e3 / steps
        key = "matrix products" if event.key in MATMUL_OPS else "attention" if event.key in ATTENTION_OPS else None
        cats[key or "other ops"] += ms
    cats["python and dispatch"] = max(wall - sum(cats.values()), 0.0)
    cats["step (unprofiled)"] = wall
    return cats


def _products(layers: list, inputs: list[torch.Tensor], head: torch.nn.Module, hidden: torch.Tensor) -> None:
    for layer in layers:
        for x, (packed, bias) in zip(inputs, layer, strict=True):
            packed_linear(x, packed, bias)
    head(hidden)


def _attention(ops: object, layers: int, q: torch.Tensor, *cache: torch.Tensor) -> None:
    scaling = q.shape[-1] ** -0.5
    for _ in range(layers):
        ops.attention(q, *cache, scaling)  # type: ignore[attr-defined]


PART_WIDTHS = (1, 4, 8, 16)
"""Forward widths (tokens) whose parts `lean_parts` times."""


def _in_features(parts: list[torch.Tensor]) -> int:
    """Inputs of a product's packed parts: ``[out, in]`` from oneDNN, ``[out/16, in/2, 16, 2]`` for our kernels,
    a quantized layout's own (`packed_linear.quant_inputs`)."""
    packed = parts[0]
    if quant_packed(packed):
        return quant_inputs(packed)
    return packed.shape[1] * (2 if packed.dim() == 4 else 1)


def lean_parts(target: LeanTarget, context: int, reps: int) -> dict[str, dict[int, float]]:
    """What a lean forward of `PART_WIDTHS` tokens spends, ms (median of ``reps``): its matrix products alone (every
    layer's four and the LM head over every row, the kernels the layer loop calls: ours or oneDNN) and its
    native attention calls alone (every layer's, over a ``context``-token cache); ``{}`` without the native ops.
    The profiler does not see inside the native layer loop, so the breakdown above counts both as Python."""
    ops = native_ops.ops()
    if ops is None or not target.native:
        return {}
    model = target.model
    text = model.config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    layers = [
        [packed_operands(group[0]) for group in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        for layer in target._layers
    ]
    head = model.lm_head
    parts: dict[str, dict[int, float]] = {"matrix products": {}, "attention": {}}
    for width in PART_WIDTHS:
        inputs = [torch.randn(width, _in_features(packed)).to(model.dtype) for packed, _ in layers[0]]
        hidden = torch.randn(1, width, text.hidden_size).to(model.dtype)
        k_cache = torch.randn(kv_heads, context + width, head_dim).to(model.dtype)
        v_cache, q = torch.randn_like(k_cache), torch.randn(heads, width, head_dim)
        keys = torch.arange(context + width)
        ends = torch.arange(context + 1, context + width + 1)
        spans = torch.stack([torch.zeros_like(ends), ends], dim=1)

        runs = (
            ("matrix products", functools.partial(_products, layers, inputs, head, hidden)),
            ("attention", functools.partial(_attention, ops, len(layers), q, k_cache, v_cache, keys, spans)),
        )
        for name, run in runs:
            parts[name][width] = timed(run, reps) * 1e3
    return parts


def prefill_times(model: torch.nn.Module, prompt: list[int], reps: int) -> dict[str, float]:
    """Median ms of the lean target's prefill of ``prompt``: through the native ops and through its PyTorch path
    (`LeanTarget` with ``native=False``), taking turns. Each prefill is cold: a new sequence of no owner, which
    reuses no earlier rows (`TargetSequence.owner`)."""
    targets = {"native ops": LeanTarget(model), "PyTorch path": LeanTarget(model, native=False)}
    times: dict[str, list[float]] = {name: [] for name in targets}
    for rep in range(reps + 1):
        for name, target in targets.items():
            seq = target.new_sequence(None)
            sync(target.device)
            start = time.perf_counter()
            target.prefill(seq, prompt)
            sync(target.device)
            if rep:
                times[name].append(time.perf_counter() - start)
            target.release(seq)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--steps", type=int, default=10, help="profiled 1-token steps")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    prompt = encode_prompt_ids(loaded)
    print("command: python " + " ".join(sys.argv))
    where = placement(loaded.model)["device"]
    print(f"model {loaded.source} ({args.dtype}) on {where}, {args.threads} threads, context {len(prompt)} tokens")
    packed_model = load_model(args.model, dtype=args.dtype, device=args.device).model  # its own copy, packed
    targets = {
        "dense": TransformersTarget(loaded.model, packed_weights=False, decode_matched=False),
        "packed": TransformersTarget(packed_model, decode_matched=False),
        "matched": TransformersTarget(packed_model),
        "lean": LeanTarget(packed_model),
    }
    exact = {name: check_exactness(target, WIDTHS[-1]) for name, target in targets.items()}
    seqs = {name: target.new_sequence() for name, target in targets.items()}
    for name, target in targets.items():
        target.prefill(seqs[name], prompt)
    all_times = step_times(targets, seqs, args.reps)
    rows = {
        name: (all_times[name], breakdown(target, seqs[name], args.steps, all_times[name][1] * 1e3))
        for name, target in targets.items()
    }
    print(f"\n{'forward of k tokens (ms)':<26}" + "".join(f"{w:>8}" for w in WIDTHS))
    for name, (times, _) in rows.items():
        print(f"{name:<26}" + "".join(f"{times[w] * 1e3:>8.1f}" for w in WIDTHS))
        print(f"{'  in 1-token steps':<26}" + "".join(f"{times[w] / times[1]:>8.2f}" for w in WIDTHS))
    for name in ("matched", "lean"):
        mine, packed = rows[name][0], rows["packed"][0]
        print(f"{name + ' / packed':<26}" + "".join(f"{mine[w] / packed[w]:>8.2f}" for w in WIDTHS))
    print()
    for name, report in exact.items():
        print(f"{name:<10} {report.line()}")
    print(f"\n{'one 1-token step (ms)':<26}" + "".join(f"{name:>10}" for name in rows))
    for category in rows["dense"][1]:
        print(f"{category:<26}" + "".join(f"{rows[name][1][category]:>10.1f}" for name in rows))
    lean = targets["lean"]
    assert isinstance(lean, LeanTarget)
    parts = lean_parts(lean, len(prompt), args.reps)
    if parts:
        kernel = native_ops.product_kernel(getattr(torch, args.dtype))
        print(f"\nlean forward, parts (ms; products on {kernel or 'oneDNN'}), by tokens")
        print(f"{'':<26}" + "".join(f"{w:>8}" for w in PART_WIDTHS))
        for name, by_width in parts.items():
            print(f"{name + ' alone':<26}" + "".join(f"{by_width[w]:>8.1f}" for w in PART_WIDTHS))
        rest = {w: all_times["lean"][w] * 1e3 - sum(p[w] for p in parts.values()) for w in PART_WIDTHS}
        print(f"{'the rest':<26}" + "".join(f"{rest[w]:>8.1f}" for w in PART_WIDTHS))
    prefill = prefill_times(packed_model, prompt, args.reps)
    shown = ", ".join(f"{path} {ms:.1f}" for path, ms in prefill.items())
    print(f"\nlean prefill of the {len(prompt)}-token prompt (ms): {shown}")


def encode_prompt_ids(loaded: LoadedModel) -> list[int]:
    """The first grounded task, chat-templated: a realistic context length for the step."""
    messages = load_prompts(GROUNDED_TASKS)[0].messages
    ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(t) for t in ids]


if __name__ == "__main__":
    main()
