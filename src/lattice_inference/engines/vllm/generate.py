"""``lattice generate --engine vllm``: one prompt through vLLM with the mapped options.

The prompt is encoded here (same ids as the local engine), vLLM generates it in its own interpreter, and the
text is printed when the generation ends (vLLM's offline engine does not stream to us).
"""

from __future__ import annotations

import argparse
import json
import sys

from lattice_inference.engines.vllm.batch import VllmRequest, VllmRun, run_batch
from lattice_inference.engines.vllm.mapping import check_mtp_head, refuse_unsupported
from lattice_inference.engines.vllm.runtime import find_runtime, vllm_model
from lattice_inference.options import DecodeOptions
from lattice_inference.prompt_codec import PromptCodec


def generate(args: argparse.Namespace, options: DecodeOptions, text: str) -> int:
    """Generate ``text``'s continuation with vLLM; print it (or ``--json``) as ``lattice generate`` does."""
    refuse_unsupported(options)
    check_mtp_head(getattr(args, "mtp_head", None))
    runtime = find_runtime(args.vllm_python)
    model = vllm_model(args.model, args.dtype)
    encoder = PromptCodec.from_folder(model.location)
    ids = encoder.encode(text, chat=encoder.has_chat_template if args.chat is None else args.chat)
    sampling = options.sampling if options.sampling.greedy else options.sampling.seeded()
    request = VllmRequest(ids, args.max_new_tokens, sampling)
    eos = encoder.eos_token_ids
    run = VllmRun(options, [request])
    ((out,),) = run_batch(runtime, model, [run], eos, engine_args=args.engine_args, threads=args.threads)
    drafted, accepted = out.spec.get("drafted_tokens", 0), out.spec.get("accepted_tokens", 0)
    metrics = {
        "prompt_tokens": out.prompt_tokens,
        "new_tokens": len(out.token_ids),
        "seconds": out.seconds,
        "tokens_per_s": len(out.token_ids) / out.seconds if out.seconds else 0.0,
        "drafts": out.spec.get("drafts", 0),
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
    }
    if args.json:
        payload = {
            "text": out.text,
            "token_ids": out.token_ids,
            "stop_reason": out.stop_reason,
            "method": options.method,
            "engine": "vllm",
            "seed": sampling.seed,
            "sampling": sampling.to_dict(),
            "metrics": metrics,
        }
        sys.stdout.write(json.dumps(payload) + "\n")
        return 0
    sys.stdout.write(out.text + "\n")
    seed = "" if sampling.seed is None else f" seed {sampling.seed},"
    print(
        f"[{options.method}, vllm {runtime.version}]{seed} {metrics['new_tokens']} tokens in {out.seconds:.2f} s "
        f"({metrics['tokens_per_s']:.1f} tok/s, prompt included), drafted {drafted}, accepted {accepted}",
        file=sys.stderr,
    )
    return 0
