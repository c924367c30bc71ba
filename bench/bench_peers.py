"""Ours against the peers on the real model, same prompts, same dtype, side by side in one run.

Engines (each request timed whole, prompt processing included, batch 1, greedy):
- transformers' ``generate``: plain greedy, and prompt lookup with ``prompt_lookup_num_tokens`` 10 and 4;
- ours (`Generator`): greedy, ``ngram`` with its defaults (adaptive draft lengths up to 10), ``ngram`` with
  ``--max-draft 4``, and ``ngram`` with ``--fixed-draft`` (every proposed token verified, up to 10: the loop
  without the planner); ours runs on its own copy of the model (our target packs its linear weights, see
  ``kernels/packed_linear.py``), transformers on an untouched one;
- ours ``mtp`` with the head shipped for the model (SmolLM2), where there is one;
- llama.cpp through ``llama-cpp-python`` (plain and ``LlamaPromptLookupDecoding`` 10 / 4), run by the Python of
  a venv that has it (``--peers-python`` or ``$LATTICE_PEERS_PYTHON``; ``peer_llamacpp.py`` says how to build
  one), on a GGUF of the same weights in the same precision given
  with ``--llamacpp-gguf``; skipped with a message otherwise;
- vLLM's engine (plain, and ``ngram`` with 10 and 4 speculative tokens, its engine in one process) through this
  package's vLLM engine (`lattice_inference.engines.vllm`), run by the Python of a venv that has vLLM
  (``--vllm-python`` or ``$LATTICE_VLLM_PYTHON``); skipped with the command that installs it otherwise. Each of
  its engines starts once (70-90 s on 2 cores) and then serves every prompt and rep one request at a time.

Reported per prompt set (grounded, chat) and for all prompts: aggregate tokens/s (median over reps), speed-up
over transformers' greedy (median over reps of the ratio within one rep), and two identical-output shares: to the
same engine's plain greedy output (is its speculation lossless?) and to transformers' greedy output. The order of
engines rotates between prompts so drifts hit all alike. ``--plot FILE`` draws tokens/s per engine and set.

    python bench/bench_peers.py --dtype bfloat16 --reps 3 --max-new-tokens 128 [--llamacpp-gguf FILE] [--plot peers.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from peer_llamacpp import llamacpp_available, peers_python  # a bench-only sibling module (the script's folder)

from lattice_inference import Generator
from lattice_inference.api import mtp_head_for
from lattice_inference.benchmark import GROUNDED_TASKS, encode_prompt, first_per_kind, load_prompts
from lattice_inference.cli import quiet_transformers
from lattice_inference.devices import placement
from lattice_inference.models.load import load_model, torch_dtype
from lattice_inference.models.source import resolve_model
from lattice_inference.mtp.head_file import shipped_head
from lattice_inference.options import DecodeOptions

HERE = Path(__file__).parent

Runner = Callable[[list[int]], list[int]]


def hf_runner(model: torch.nn.Module, lookup: int | None, max_new: int, eos: int, static: bool = False) -> Runner:
    """transformers' own greedy ``generate``, with prompt lookup of ``lookup`` tokens when given, or with a static
    cache (which ``generate`` compiles with ``torch.compile``) when ``static``."""
    extra: dict[str, object] = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    if static:  # transformers' best on a GPU: a static cache, its forward compiled by generate itself
        extra["cache_implementation"] = "static"

    def run(ids: list[int]) -> list[int]:
        x = torch.tensor([ids], device=model.device)
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=eos,
            **extra,
        )
        return [t for t in out[0, len(ids) :].tolist() if t != eos]

    return run


def ours_runner(gen: Generator, max_new: int) -> Runner:
    return lambda ids: gen.generate(ids, max_new_tokens=max_new).token_ids


def run_vllm(
    python: str | None, args: argparse.Namespace, prompts: list[list[int]], eos: list[int], skipped: set[str]
) -> dict:
    """vLLM's plain and ngram engines over every prompt and rep (batch 1), keyed by engine name; empty with a
    message where no interpreter has vLLM."""
    from lattice_inference.engines.vllm.batch import VllmRequest, VllmRun, run_batch
    from lattice_inference.engines.vllm.runtime import find_runtime, vllm_model
    from lattice_inference.errors import ConfigError

    try:
        runtime = find_runtime(python)
    except ConfigError as exc:
        print(f"[peers] vLLM skipped: {exc}", file=sys.stderr)
        return {}
    model = vllm_model(args.model, args.dtype)
    order = [(rep, i) for rep in range(args.reps) for i in range(len(prompts))]
    requests = [VllmRequest(prompts[i], args.max_new_tokens) for _, i in order]
    engines = {
        "vllm greedy": DecodeOptions(method="greedy"),
        "vllm ngram 10": DecodeOptions(method="ngram", max_draft=10),
        "vllm ngram 4": DecodeOptions(method="ngram", max_draft=4),
    }
    engines = {name: options for name, options in engines.items() if name not in skipped}
    runs = [VllmRun(options, requests, warmup=True) for options in engines.values()]
    done = run_batch(runtime, model, runs, eos, threads=torch.get_num_threads())
    return {
        name: [
            {"prompt": i, "rep": rep, "token_ids": out.token_ids, "seconds": out.seconds}
            for (rep, i), out in zip(order, outputs, strict=True)
        ]
        for name, outputs in zip(engines, done, strict=True)
    }


def run_llamacpp(
    python: Path, gguf: str, prompts: list[list[int]], max_new: int, reps: int, skipped: set[str]
) -> dict[str, list[dict]]:
    """Run the llama.cpp engines in the peers venv (a subprocess); their results keyed by engine name."""
    with tempfile.TemporaryDirectory() as tmp:
        req, out = Path(tmp) / "req.json", Path(tmp) / "out.json"
        methods = {"llama.cpp": None, "llama.cpp lookup 10": 10, "llama.cpp lookup 4": 4}
        methods = {name: lookup for name, lookup in methods.items() if name not in skipped}
        req.write_text(json.dumps({"max_new_tokens": max_new, "methods": methods, "prompts": prompts}))
        cmd = [
            str(python),
            str(HERE / "peer_llamacpp.py"),
            "--gguf",
            gguf,
            "--requests",
            str(req),
            "--out",
            str(out),
            "--reps",
            str(reps),
            "--threads",
            str(torch.get_num_threads()),
        ]
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


PLAIN = {"transformers": "transformers greedy", "ours": "ours greedy", "llama.cpp": "llama.cpp", "vllm": "vllm greedy"}
"""Each engine family's plain greedy decoding, the output its speculative methods must reproduce."""


def plain_of(engine: str) -> str:
    """The plain engine of ``engine``'s family (`PLAIN`)."""
    return PLAIN[next(family for family in PLAIN if engine.startswith(family))]


def summarise(results: dict[str, list[dict]], prompts: list, reference: str) -> dict[str, dict]:
    """Per set: tokens/s, speed-up over ``reference``, identical shares (to the engine's own plain output and to
    ``reference``'s), per engine."""
    sets = {"all": list(range(len(prompts)))}
    for i, p in enumerate(prompts):
        sets.setdefault(p.set or p.kind, []).append(i)
    first = {engine: {r["prompt"]: r["token_ids"] for r in runs if r["rep"] == 0} for engine, runs in results.items()}
    ref_ids = first.get(reference, {})

    def rep_tps(runs: list[dict], rep: int, wanted: set[int]) -> float | None:
        mine = [r for r in runs if r["rep"] == rep and r["prompt"] in wanted]
        seconds = sum(r["seconds"] for r in mine)
        return sum(len(r["token_ids"]) for r in mine) / seconds if seconds > 0 else None

    def share(flags: list[bool]) -> float | None:
        return sum(flags) / len(flags) if flags else None

    table: dict[str, dict] = {}
    for name, idx in sets.items():
        wanted = set(idx)
        rows = {}
        for engine, runs in results.items():
            reps = sorted({r["rep"] for r in runs})
            pairs = [(rep_tps(runs, rep, wanted), rep_tps(results[reference], rep, wanted)) for rep in reps]
            tps = [a for a, _ in pairs if a is not None]
            if not tps:  # no row of this engine in this set (a peer that failed early, a prompt it skipped)
                continue
            own = first.get(plain_of(engine), {})
            first_rows = [r for r in runs if r["rep"] == 0 and r["prompt"] in wanted]
            ratios = [a / b for a, b in pairs if a is not None and b]
            rows[engine] = {
                "tokens_per_s": statistics.median(tps),
                "speedup": statistics.median(ratios) if ratios else None,
                "identical": share([r["token_ids"] == ref_ids.get(r["prompt"]) for r in first_rows]),
                "identical_to_own_plain": share([r["token_ids"] == own.get(r["prompt"]) for r in first_rows]),
            }
        table[name] = {"prompts": len(idx), "engines": rows}
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", default=str(GROUNDED_TASKS))
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("auto", "bfloat16", "float16", "float32"),
        help="ours and the peers' dtype; auto: ours as `--dtype auto` loads it (a GGUF file kept quantized on a CPU), "
        "transformers in the dtype auto dequantizes to",
    )
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto (vLLM and llama.cpp: CPU)")
    ap.add_argument(
        "--hf-static",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run transformers with a static cache and torch.compile (default: on a GPU only)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--limit", type=int, help="first N prompts only")
    ap.add_argument("--per-kind", type=int, help="first N prompts of each kind only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp-gguf", help="GGUF of the same weights in the same precision, for llama.cpp")
    ap.add_argument("--peers-python", help="Python of the venv with llama-cpp-python (default: $LATTICE_PEERS_PYTHON)")
    ap.add_argument("--vllm-python", help="Python of the venv with vLLM (default: $LATTICE_VLLM_PYTHON)")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM (its engines take minutes to start)")
    ap.add_argument("--skip", default="", help="comma-separated engine names to leave out, e.g. 'ours ngram fixed'")
    ap.add_argument(
        "--json",
        help="write the full report here (default: a bench_peers-*.json in the temporary folder); the measured rows "
        "are written after every prompt, so a failure later loses none",
    )
    ap.add_argument("--plot", help="write a PNG of tokens/s per engine and prompt set here (needs matplotlib)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    # never packed: transformers as users run it (under auto, in the dtype auto dequantizes a GGUF file to)
    hf_dtype = args.dtype
    if args.dtype == "auto":
        hf_dtype = str(torch_dtype("auto", resolve_model(args.model), args.device, ours=False)).removeprefix("torch.")
    reference_model = load_model(args.model, dtype=hf_dtype, device=args.device).model
    eos = loaded.eos_token_ids[0]
    prompts = first_per_kind(load_prompts(args.prompts), args.per_kind)[: args.limit]

    def ours(**kw: object) -> Generator:
        return Generator(loaded.model, loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, **kw)  # type: ignore[arg-type]

    greedy = ours(method="greedy")
    encoded = [encode_prompt(greedy, p) for p in prompts]
    n = args.max_new_tokens
    runners: dict[str, Runner] = {
        "transformers greedy": hf_runner(reference_model, None, n, eos),
        "transformers lookup 10": hf_runner(reference_model, 10, n, eos),
        "transformers lookup 4": hf_runner(reference_model, 4, n, eos),
        "transformers static compile": hf_runner(reference_model, None, n, eos, static=True),
        "ours greedy": ours_runner(greedy, n),
        "ours ngram": ours_runner(ours(method="ngram"), n),
        "ours ngram max-draft 4": ours_runner(ours(method="ngram", max_draft=4), n),
        "ours ngram fixed": ours_runner(ours(method="ngram", adaptive=False), n),
    }
    if shipped_head(loaded.source) is not None:
        head = mtp_head_for(loaded, DecodeOptions(method="mtp").draft_length)
        runners["ours mtp"] = ours_runner(ours(method="mtp", mtp_head=head), n)
    skipped = {name.strip() for name in args.skip.split(",") if name.strip()}
    static = args.hf_static if args.hf_static is not None else reference_model.device.type == "cuda"
    if not static:
        skipped.add("transformers static compile")
    runners = {name: run for name, run in runners.items() if name not in skipped}
    names = list(runners)
    for run in runners.values():  # warm-up
        run(encoded[0][:64])
    results: dict[str, list[dict]] = {name: [] for name in names}
    saved = Path(args.json or Path(tempfile.gettempdir()) / f"bench_peers-{time.strftime('%Y%m%d-%H%M%S')}.json")

    def save(table: dict | None = None) -> None:
        """Every measured row (and the table once there is one), written atomically."""
        tmp = saved.with_suffix(".tmp")
        tmp.write_text(json.dumps({"args": vars(args), "table": table, "results": results}))
        tmp.replace(saved)

    print(f"[peers] measured rows go to {saved} as they come", file=sys.stderr)
    for rep in range(args.reps):
        for i, ids in enumerate(encoded):
            k = (rep + i) % len(names)
            for name in names[k:] + names[:k]:
                start = time.perf_counter()
                out = runners[name](ids)
                results[name].append(
                    {"prompt": i, "rep": rep, "token_ids": out, "seconds": time.perf_counter() - start}
                )
            save()
            print(f"[peers] rep {rep + 1}/{args.reps} prompt {i + 1}/{len(encoded)}", file=sys.stderr, flush=True)
    if args.llamacpp_gguf:
        python = peers_python(args.peers_python)
        missing = llamacpp_available(python)
        if missing or python is None:
            print(f"[peers] llama.cpp skipped: {missing}", file=sys.stderr)
        else:
            try:
                results.update(run_llamacpp(python, args.llamacpp_gguf, encoded, n, args.reps, skipped))
            except (OSError, subprocess.SubprocessError, ValueError) as exc:
                print(f"[peers] llama.cpp failed: {exc!r}", file=sys.stderr)
    else:
        print("[peers] llama.cpp skipped: no --llamacpp-gguf given", file=sys.stderr)
    if not args.no_vllm:
        try:  # a peer that fails loses its own rows only, never the rows measured before it
            results.update(run_vllm(args.vllm_python, args, encoded, loaded.eos_token_ids, skipped))
        except Exception as exc:  # any failure of the peer: report it and go on
            print(f"[peers] vLLM failed: {exc!r}", file=sys.stderr)
    save()
    # the reference: transformers' greedy, or ours where --skip left it out
    reference = next(e for e in ("transformers greedy", "ours greedy", *results) if e in results)
    table = summarise(results, prompts, reference)
    save(table)
    print("command: python " + " ".join(sys.argv))
    where = placement(loaded.model)["device"]
    threads = torch.get_num_threads()
    print(f"model {loaded.source} ({args.dtype}) on {where}, {n} new tokens, {args.reps} reps, {threads} threads")
    for name, group in table.items():
        print(f"\n== {name}: {group['prompts']} prompts ==")
        print(f"{'engine':<26} {'tok/s':>7} {'vs ' + reference:>23} {'= own plain':>12} {'= ' + reference:>15}")
        for engine, r in group["engines"].items():
            print(
                f"{engine:<26} {r['tokens_per_s']:>7.1f} {_fmt(r['speedup'], '.2f', 22)}x "
                f"{_fmt(r['identical_to_own_plain'], '.0%', 12)} {_fmt(r['identical'], '.0%', 15)}"
            )
    print(f"[peers] report and rows in {saved}", file=sys.stderr)
    if args.plot:
        plot(table, args.plot, f"{Path(str(loaded.source)).name}, {args.dtype}, {torch.get_num_threads()} threads")


def _fmt(value: float | None, spec: str, width: int) -> str:
    """``value`` in ``spec`` right-aligned to ``width``; ``-`` where there is nothing to compare with."""
    return f"{'-' if value is None else format(value, spec):>{width}}"


def plot(table: dict[str, dict], path: str, title: str) -> None:
    """Tokens/s per engine (bars) for each prompt set, to a PNG at ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[peers] --plot needs matplotlib: pip install 'lattice-inference[plot]'", file=sys.stderr)
        return
    sets = list(table)
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 5), squeeze=False)
    for ax, name in zip(axes[0], sets, strict=True):
        engines = table[name]["engines"]
        names = list(engines)
        speeds = [engines[e]["tokens_per_s"] for e in names]
        colors = ["tab:blue" if e.startswith("ours") else "tab:gray" for e in names]
        ax.barh(names, speeds, color=colors)
        for y, (e, v) in enumerate(zip(names, speeds, strict=True)):
            ax.text(v, y, f" {v:.0f} ({_fmt(engines[e]['speedup'], '.2f', 0)}x)", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("tokens/s (whole requests, batch 1)")
        ax.set_title(f"{name}: {table[name]['prompts']} prompts")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"[peers] plot written to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
