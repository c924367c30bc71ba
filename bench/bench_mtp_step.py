"""Cost of one MTP draft step (and of MTP cache catch-up) as a fraction of one target decode step.

Target: random-weight Qwen3.5-0.8B-shaped text model in bfloat16 (hidden 1024, 24 layers = 18 Gated DeltaNet +
6 full attention, 8 query / 2 KV heads of 256, delta-net 16/16 heads of 128, intermediate 3584, vocab 248320, tied
embeddings); the shape is assumed, not read from a hub checkpoint. MTP head: the matching dense Qwen3.5 MTP layer
(fc 2048 -> 1024, one gated-attention layer, SwiGLU 3584) sharing the target's tied embedding as its lm_head,
bfloat16, random weights. Both caches hold a ``--prompt``-token context. ``torch.set_num_threads(--threads)``.

Columns, timed round-robin so host noise hits all alike (median of ``--reps`` rounds after one warm-up round), as
wall-clock time and as process CPU time (steadier when other jobs share the cores):

* ``step``: one plain transformers decode step (1 token, ``logits_to_keep=1``), the unit of every ratio;
* ``mtp draft``: one ``MtpHead.forward_one`` (full 248320-entry float32 logits) then a cache rollback;
* ``mtp draft (top-N vocab)``: the same step with ``set_draft_vocab`` restricting the draft argmax to ``N`` token ids
  (``--draft-vocab``; lossless, since every draft is verified by the target);
* ``mtp catch-up k``: ``forward_many`` of k rows without logits (the per-verification cache rebuild), then rollback.

Run: ``.venv/bin/python bench/bench_mtp_step.py`` (about 1-2 minutes on 2 cores). ``--model smollm2`` measures
a real model (float32) with its MTP head instead (the shipped one, or ``--mtp-head DIR``), hiddens still random.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from lattice_inference.api import mtp_head_for
from lattice_inference.models.load import load_model
from lattice_inference.mtp import MtpConfig, MtpHead, MtpWeights
from lattice_testing.toy import qwen35_08b_shape_config

CATCH_UP = (1, 4, 8)


def random_mtp(cfg: MtpConfig, embed: torch.Tensor, std: float = 0.02) -> MtpWeights:
    """Random dense MTP weights in bfloat16 sharing the target's tied embedding."""
    h, hd, i = cfg.hidden_size, cfg.head_dim, int(cfg.intermediate_size or 0)
    n_h, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape) * std).to(torch.bfloat16)

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.bfloat16)

    return MtpWeights(
        fc=rnd(h, 2 * h),
        pre_fc_norm_embedding=zeros(h),
        pre_fc_norm_hidden=zeros(h),
        norm=zeros(h),
        input_layernorm=zeros(h),
        post_attention_layernorm=zeros(h),
        q_proj=rnd(2 * n_h * hd, h),
        k_proj=rnd(n_kv * hd, h),
        v_proj=rnd(n_kv * hd, h),
        o_proj=rnd(h, n_h * hd),
        q_norm=zeros(hd),
        k_norm=zeros(hd),
        embed_tokens=embed,
        lm_head=embed,
        layout="dense",
        mlp_gate=rnd(i, h),
        mlp_up=rnd(i, h),
        mlp_down=rnd(h, i),
    )


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock and process CPU seconds of one call (CPU time is steadier on a shared host)."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=512, help="context length in tokens")
    parser.add_argument("--reps", type=int, default=9, help="timed rounds (median reported)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft-vocab", type=int, default=32768, help="N for the restricted-vocabulary column")
    parser.add_argument(
        "--model",
        help="measure a real model and its MTP head instead (e.g. smollm2 with its shipped head; float32; "
        "--mtp-head for another head)",
    )
    parser.add_argument("--mtp-head", help="with --model: a head written by lattice train-mtp")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("command:", shlex.join([sys.executable, *sys.argv]))

    torch.manual_seed(0)
    t0 = time.perf_counter()
    if args.model:
        loaded = load_model(args.model, dtype="float32")
        model = loaded.model
        head = mtp_head_for(loaded, 2, loaded.model.config.vocab_size, args.mtp_head)
        limited = mtp_head_for(loaded, 2, args.draft_vocab, args.mtp_head)
        dtype = torch.float32
    else:
        hf_config = qwen35_08b_shape_config()
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
        cfg = MtpConfig.from_hf_config(hf_config)
        embed = model.get_input_embeddings().weight.detach()
        head = MtpHead(cfg, random_mtp(cfg, embed))
        limited = MtpHead(cfg, random_mtp(cfg, embed))
        limited.set_draft_vocab(range(args.draft_vocab))
        dtype = torch.bfloat16
    cfg = head.config
    n_params = sum(p.numel() for p in model.parameters())
    print(f"target: {n_params / 1e6:.0f} M params, {dtype}, ready in {time.perf_counter() - t0:.1f} s")
    layer = head._layer
    mtp_params = sum(t.numel() for t in (layer.fc, layer.qkv, layer.o, head._mlp_gate_up, head._mlp_down))
    print(f"MTP layer: {mtp_params / 1e6:.1f} M params + shared lm_head {head._lm_head.numel() / 1e6:.0f} M")

    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    prompt = torch.randint(0, vocab, (args.prompt,)).tolist()
    cache = DynamicCache(config=model.config)
    length = 0

    def target_step(ids: list[int]) -> None:
        nonlocal length
        with torch.inference_mode():
            model(
                input_ids=torch.tensor([ids]),
                position_ids=torch.arange(length, length + len(ids)).unsqueeze(0),
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        length += len(ids)

    t0 = time.perf_counter()
    target_step(prompt)
    print(f"target prefill {args.prompt} tokens: {time.perf_counter() - t0:.2f} s")
    hiddens = torch.randn(args.prompt, hidden).to(dtype)
    for h in (head, limited):
        t0 = time.perf_counter()
        h.prefill(hiddens[:-1], prompt[1:], 0)
    print(f"MTP catch-up over the prompt ({args.prompt - 1} rows, no logits): {time.perf_counter() - t0:.2f} s")

    def mtp_draft(h: MtpHead, restricted: bool) -> Callable[[], None]:
        def run() -> None:
            start = h.cache_len
            if restricted:
                h.draft_tokens(1, start, hiddens[-1], num_tokens=1)
            else:
                h.forward_one(1, start, hiddens[-1])
            h.rollback_cache_to(start)

        return run

    def catch_up(k: int) -> Callable[[], None]:
        def run() -> None:
            start = head.cache_len
            head.forward_many([1] * k, range(start, start + k), hiddens[:k], return_logits=False)
            head.rollback_cache_to(start)

        return run

    columns: dict[str, Callable[[], None]] = {
        "step": lambda: target_step([1]),
        "mtp draft": mtp_draft(head, False),
        f"mtp draft (top-{args.draft_vocab} vocab)": mtp_draft(limited, True),
    }
    for k in CATCH_UP:
        columns[f"mtp catch-up {k}"] = catch_up(k)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in columns}
    for rep in range(args.reps + 1):
        for name, fn in columns.items():
            seconds = timed(fn)
            if rep:
                times[name].append(seconds)
    wall = {name: statistics.median(t[0] for t in ts) for name, ts in times.items()}
    cpu = {name: statistics.median(t[1] for t in ts) for name, ts in times.items()}
    print(
        f"\nmedian of {args.reps} rounds; one target decode step = {wall['step'] * 1e3:.1f} ms wall, "
        f"{cpu['step'] * 1e3:.1f} ms CPU (ratio 1.00)"
    )
    print("| column | wall ms | ratio | CPU ms | ratio |")
    print("|---|---|---|---|---|")
    for name in columns:
        print(
            f"| {name} | {wall[name] * 1e3:.2f} | {wall[name] / wall['step']:.3f} | "
            f"{cpu[name] * 1e3:.2f} | {cpu[name] / cpu['step']:.3f} |"
        )


if __name__ == "__main__":
    main()
