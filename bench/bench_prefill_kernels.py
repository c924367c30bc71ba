"""Where a prefill's time goes, kernel by kernel, each against its bound on this CPU (issue 68's rooflines).

Loads a model as `lattice` runs it (a GGUF file as stored), takes its first layer's real packed weights and times,
for a chunk of ``--rows`` prompt rows, every kernel of a prompt layer through the same native ops the layer loop
calls: the fused q/k/v, o, fused gate/up and down products (each in the file's own format), the norms, the q/k
rotary embedding with the cache write, the attention over a cache of each ``--contexts`` length, and the gated
activation. Medians of ``--reps`` calls. Per kernel it prints milliseconds, the share of the layer, and:

- products: GMAC/s against the **int8 bound** of the kernel's widest instruction at the clock (`INT8_MACS_PER_CYCLE`;
  a prompt chunk's product reads each weight once per pass of rows, from the cache, so memory is not its bound);
- attention: GMAC/s (scores and values) against the float32 FMA bound (``--fma-gmacs`` per core: 2 FMA ports x
  8 lanes x the clock);
- element-wise ops: bytes moved per second.

A last line compares the sum of the kernels times the layer count with one whole cold prefill of ``--rows`` tokens
through the target (the layer loop), so what the table misses shows as the difference.

    python bench/bench_prefill_kernels.py --model qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --threads 2 \
        --rows 512 --contexts 512,4096,8192,16384
"""

from __future__ import annotations

import argparse
import statistics
from types import ModuleType

import torch
from bench_attention import causal_chunk, timed
from bench_prefill import prefill_seconds
from bench_serve_concurrency import cpu_line

from lattice_inference.cli import quiet_transformers
from lattice_inference.kernels import native_ops
from lattice_inference.kernels.packed_linear import packed_operands
from lattice_inference.kernels.quant_linear import quant_format
from lattice_inference.models.load import load_model
from lattice_inference.targets import LeanTarget, make_target
from lattice_inference.targets.lean_forward import Layer, product


def packed_parts(group: list) -> list[torch.Tensor]:
    """The packed weight tensors a product group runs (`packed_operands`: one fused matrix, or its parts)."""
    parts: list[torch.Tensor] = []
    for member in group:
        operands = packed_operands(member)
        if operands is not None:
            parts.extend(operands[0])
    return parts


def fmt_of(parts: list[torch.Tensor]) -> str:
    """The formats of a product's packed parts (``Q5_0`` or ``Q5_0+Q8_0``), or the dtype where not quantized."""
    names = []
    for part in parts:
        name = quant_format(part) if part.dtype == torch.uint8 and part.dim() == 3 else None
        names.append(name or str(part.dtype).replace("torch.", ""))
    return "+".join(dict.fromkeys(names)) or "?"


INT8_MACS_PER_CYCLE = {"avx2": 64, "avx512": 128, "avx512_vnni": 128, "amx_int8": 1024}
"""Per core and clock, the integer multiply-adds of the widest int8 instruction a quantized product can use, at two
issued a cycle (one for AMX's tile product): ``vpmaddubsw`` ymm (32 pairs), ``vpmaddubsw``/``vpdpbusd`` zmm (64),
``tdpbusd`` (16 x 16 x 64 over 16 cycles). An upper bound: the unpacking of nibbles, the widening sums and the
per-block float steps come on top."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="as `lattice bench --model` (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=512, help="prompt rows per chunk")
    parser.add_argument("--contexts", default="512,4096,8192,16384", help="cache lengths the chunk's attention sees")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--fma-gmacs",
        type=float,
        default=0.0,
        help="float32 FMA GMAC/s per core for the attention bound (0: 16 x the clock, read here)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    ops = native_ops.ops()
    if ops is None:
        raise SystemExit(f"the native ops do not run here: {native_ops.unavailable()}")
    loaded = load_model(args.model)
    target = make_target(loaded.model, prefix_cache=False)
    if not isinstance(target, LeanTarget) or not target.native:
        raise SystemExit("this model or machine does not run the lean forward's native ops")
    config = loaded.model.config
    layer: Layer = target._layers[0]
    layers = len(target._layers)
    n = args.rows
    hidden = config.hidden_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    clock = clock_ghz()
    fma = args.fma_gmacs or 16 * clock
    kernel = ops.quant_linear_tiles() or ops.quant_linear_kernel()
    int8_peak = INT8_MACS_PER_CYCLE.get(kernel, 64) * clock * args.threads
    print(
        f"# {cpu_line()}; {clock:.2f} GHz; {args.threads} threads; quant kernel {ops.quant_linear_kernel()}"
        f"{' + ' + ops.quant_linear_tiles() if ops.quant_linear_tiles() else ''}; model {args.model}; "
        f"{layers} layers; {n} rows a chunk"
    )
    x = torch.randn(n, hidden)
    rows: list[tuple[str, float, str]] = []

    def add(name: str, seconds: float, note: str) -> None:
        rows.append((name, seconds, note))
        print(f"{name:<28} {seconds * 1e3:>9.2f} ms  {note}", flush=True)

    for name, group in (("q/k/v", layer.qkv), ("o", layer.o), ("gate/up", layer.gate_up), ("down", layer.down)):
        parts = packed_parts(group)
        width_in = {"o": heads * head_dim, "down": config.intermediate_size}.get(name, hidden)
        xin = torch.randn(n, width_in)
        seconds = timed(lambda g=group, v=xin: product(g, v), args.reps)
        outs = sum(int(p.shape[0]) * 16 for p in parts if p.dtype == torch.uint8) or 0
        macs = n * outs * width_in
        bound = int8_peak if any(p.dtype == torch.uint8 for p in parts) else None
        rate = macs / seconds / 1e9
        note = f"{fmt_of(parts):<10} {rate:6.1f} GMAC/s"
        if bound:
            note += f"  int8 bound {bound:6.1f} ({rate / bound:4.0%})"
        add(f"product {name}", seconds, note)

    weight = torch.ones(hidden)
    add("rms_norm", timed(lambda: ops.rms_norm(x, weight, 1e-6), args.reps), bytes_note(2 * x.nbytes, 0))
    y = torch.randn(n, hidden)
    xx = x.clone()
    norm_s = timed(lambda: ops.add_rms_norm(xx, y, weight, 1e-6), args.reps)
    add("add_rms_norm x2", 2 * norm_s, bytes_note(4 * x.nbytes, norm_s))
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim)
    cos, sin = torch.randn(n, head_dim), torch.randn(n, head_dim)
    k_buf, v_buf = torch.empty(kv_heads, n, head_dim), torch.empty(kv_heads, n, head_dim)
    q_w = None if layer.q_weight is None else layer.q_weight
    k_w = None if layer.k_weight is None else layer.k_weight
    rope = timed(lambda: ops.rope_qk_cache(qkv, q_w, k_w, 1e-6, cos, sin, k_buf, v_buf, 0, heads, kv_heads), args.reps)
    add("rope_qk_cache", rope, bytes_note(2 * qkv.nbytes, rope))
    gate_up = torch.randn(n, 2 * config.intermediate_size)
    act = ops.gelu_tanh_mul if layer.gelu else ops.silu_mul
    act_s = timed(lambda: act(gate_up), args.reps)
    add("silu_mul", act_s, bytes_note(gate_up.nbytes * 3 // 2, act_s))
    fixed = sum(s for _, s, _ in rows)
    for context in (int(v) for v in args.contexts.split(",")):
        seconds, macs = attention_at(ops, context, n, heads, kv_heads, head_dim, args.reps)
        rate = macs / seconds / 1e9
        bound = fma * args.threads
        add(f"attention at {context}", seconds, f"{rate:6.1f} GMAC/s  f32 FMA bound {bound:6.1f} ({rate / bound:4.0%})")
        layer_s = fixed + seconds
        print(
            f"  a layer at {context}: {layer_s * 1e3:.1f} ms, products {share(rows, 'product', layer_s)}, "
            f"attention {seconds / layer_s:.0%}; {n / (layer_s * layers):.0f} prompt rows/s from kernels alone"
        )
    prompt = torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = statistics.median(prefill_seconds(target, prompt) for _ in range(args.reps))
    first = fixed + rows[-len(args.contexts.split(","))][1]
    print(
        f"whole prefill of {n} tokens: {whole * 1e3:.1f} ms ({n / whole:.0f} rows/s); kernels x {layers} layers at "
        f"{args.contexts.split(',')[0]} keys: {first * layers * 1e3:.1f} ms ({first * layers / whole:.0%})"
    )


def bytes_note(nbytes: int, seconds: float) -> str:
    """Bytes moved and their rate."""
    rate = f"  {nbytes / seconds / 1e9:5.2f} GB/s" if seconds else ""
    return f"{nbytes / 2**20:6.1f} MiB{rate}"


def share(rows: list[tuple[str, float, str]], prefix: str, total: float) -> str:
    """The share of ``total`` that the rows named ``prefix...`` take."""
    return f"{sum(s for name, s, _ in rows if name.startswith(prefix)) / total:.0%}"


def attention_at(
    ops: ModuleType, context: int, n: int, heads: int, kv_heads: int, head_dim: int, reps: int
) -> tuple[float, int]:
    """Seconds of one chunk of ``n`` rows attending causally to a cache of ``context`` keys (the chunk its last
    ``n``), and the multiply-adds of its scores and value sums."""
    q, k_cache, v_cache, keys, spans, macs = causal_chunk(heads, kv_heads, head_dim, n, max(context, n))
    return timed(lambda: ops.attention(q, k_cache, v_cache, keys, spans, head_dim**-0.5), reps), macs


def clock_ghz() -> float:
    """This CPU's clock in GHz as ``/proc/cpuinfo`` reports it (3.0 where it does not)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("cpu MHz"):
                    return float(line.split(":", 1)[1]) / 1000
    except OSError:
        pass
    return 3.0


if __name__ == "__main__":
    main()
