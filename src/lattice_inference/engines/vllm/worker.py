"""Batch generation inside vLLM's interpreter: ``python worker.py JOB.json RESULT.json``.

Runs as a script in whichever environment has vLLM (it imports only the standard library and vLLM, so this
package need not be installed there). ``JOB.json`` is ``{"runs": [{"argv": [engine flags], "warmup": bool,
"together": bool, "requests": [{"prompt_token_ids": [...], "sampling": {SamplingParams kwargs}}]}]}``: each run
starts one engine from the flags (parsed by vLLM's own ``EngineArgs`` parser, as its server parses them), runs
its requests one at a time (batch 1, each timed) or all together, then frees the engine. ``RESULT.json`` gets,
per run and request, the generated ids, text, finish reason, wall seconds and speculative-decoding counters.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from typing import Any

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "drafted_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


def build_llm(argv: list[str]) -> Any:
    """An ``LLM`` from command-line engine flags, through vLLM's own parser."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layouts
        from vllm.utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return LLM.from_engine_args(EngineArgs.from_cli_args(parser.parse_args(argv)))


def spec_counters(llm: Any) -> dict[str, int]:
    """vLLM's cumulative drafted and accepted token counts (empty where its metrics API is missing)."""
    try:
        metrics = llm.get_metrics()
    except Exception:
        return {}
    return {SPEC_COUNTERS[m.name]: int(m.value) for m in metrics if m.name in SPEC_COUNTERS and hasattr(m, "value")}


def _result(out: Any, seconds: float, before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    completion = out.outputs[0]
    return {
        "token_ids": list(completion.token_ids),
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "prompt_tokens": len(out.prompt_token_ids or []),
        "seconds": seconds,
        "spec": {k: after[k] - before.get(k, 0) for k in after},
    }


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Every run of ``job`` in turn; one engine alive at a time."""
    from vllm import SamplingParams, TokensPrompt

    results = []
    for spec in job["runs"]:
        started = time.perf_counter()
        llm = build_llm(spec["argv"])
        start_s = time.perf_counter() - started
        requests = spec["requests"]
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
        params = [SamplingParams(**r["sampling"]) for r in requests]
        if spec.get("warmup") and prompts:
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        outs = []
        if spec.get("together"):
            before, t0 = spec_counters(llm), time.perf_counter()
            done = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            outs = [_result(o, seconds, before, spec_counters(llm)) for o in done]
        else:
            for prompt, param in zip(prompts, params, strict=True):
                before, t0 = spec_counters(llm), time.perf_counter()
                (done,) = llm.generate([prompt], param, use_tqdm=False)
                outs.append(_result(done, time.perf_counter() - t0, before, spec_counters(llm)))
        results.append({"engine_start_s": start_s, "outputs": outs})
        del llm
        gc.collect()
    return {"runs": results}


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        job = json.load(f)
    result = run(job)
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM may spawn workers that re-import this file
    main()
