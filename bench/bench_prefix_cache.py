"""The prefix cache on interleaved agentic work: prefill time with and without reused prompt rows, side by side.

The packaged agentic traces' (or ``--traces``) requests are sent round-robin across traces (request 1 of every
trace, then request 2 of every trace, ...), as a server sees several agents or conversations at once, to one method
under three prefix cache settings, each its own `Generator` (its own target and caches) over the same weights,
taking turns request by request:

- ``off``: ``prefix_cache=False``, every prompt row computed;
- ``live``: ``prefix_budget=0``, only the live cache (the previous request's rows) reused;
- ``kept``: the default, the live cache and earlier sequences' caches up to ``prefix_budget`` tokens.

Conversation traces' requests carry the earlier answers (``off``'s greedy text, fixed before the timed runs). It
prints per setting: prefill seconds in all, median prefill per request, the share of prompt tokens reused, whole
request seconds (prefill and decode), and whether every output equals ``off``'s token for token.

    python bench/bench_prefix_cache.py --dtype bfloat16 --threads 2
    python bench/bench_prefix_cache.py --dtype bfloat16 --threads 2 --traces bench/long_document_trace.jsonl
"""

from __future__ import annotations

import argparse
import statistics

import torch

from lattice_inference import traces
from lattice_inference.api import Generator
from lattice_inference.cli import quiet_transformers
from lattice_inference.models.load import load_model
from lattice_inference.options import DecodeOptions

SETTINGS = {"off": {"prefix_cache": False}, "live": {"prefix_budget": 0}, "kept": {}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="as `lattice bench --model` (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--method", default="ngram")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--traces",
        default=str(traces.AGENTIC_TRACES),
        help="a trace file as `lattice bench --traces` takes (default: the packaged agentic traces; "
        "bench/long_document_trace.jsonl: questions over a 2800-token document)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    loaded = load_model(args.model, dtype=args.dtype)
    gens = {
        name: Generator(
            loaded.model,
            loaded.tokenizer,
            DecodeOptions(method=args.method).updated(**settings),
            eos_token_ids=loaded.eos_token_ids,
        )
        for name, settings in SETTINGS.items()
    }
    trace_list = traces.load_traces(args.traces)
    reference = gens["off"]

    def answer(ids: list[int], budget: int) -> str:
        return reference.generate(ids, budget).text  # every method's text is greedy's

    per_trace = traces.encode_traces(trace_list, reference.codec, args.max_new_tokens, answer)
    rounds = max(len(t) for t in per_trace)
    requests = [t[i] for i in range(rounds) for t in per_trace if i < len(t)]
    for gen in gens.values():  # warm-up: the self-check, cost calibration, first forwards of each shape
        gen.generate(requests[0][0][:64], 8)
        gen.decoder.target.forget_prefix()
    stats: dict[str, dict[str, list[float]]] = {name: {"prefill": [], "request": []} for name in gens}
    cached = dict.fromkeys(gens, 0)
    prompt_tokens = 0
    identical = dict.fromkeys(gens, 0)
    names = list(gens)
    for n, (ids, budget) in enumerate(requests):
        order = names[n % len(names) :] + names[: n % len(names)]
        outs = {name: gens[name].generate(ids, budget) for name in order}
        prompt_tokens += len(ids)
        for name, out in outs.items():
            m = out.metrics
            stats[name]["prefill"].append(m.prefill_s)
            stats[name]["request"].append(m.prefill_s + m.decode_s)
            cached[name] += m.cached_prompt_tokens
            identical[name] += out.token_ids == outs["off"].token_ids
    print(f"model {loaded.source}, {args.dtype}, {args.threads} threads, method {args.method}, {len(requests)} "
          f"requests of {len(trace_list)} traces interleaved, {prompt_tokens} prompt tokens")  # fmt: skip
    print(f"{'setting':<8} {'prefill s':>10} {'median prefill':>15} {'reused':>7} {'request s':>10} {'identical':>10}")
    for name, s in stats.items():
        print(
            f"{name:<8} {sum(s['prefill']):>10.2f} {statistics.median(s['prefill']) * 1000:>12.1f} ms "
            f"{cached[name] / prompt_tokens:>7.0%} {sum(s['request']):>10.2f} {identical[name] / len(requests):>10.0%}"
        )


if __name__ == "__main__":
    main()
