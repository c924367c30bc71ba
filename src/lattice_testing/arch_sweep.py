"""Every causal-LM architecture of the installed transformers, built tiny and run as a user's folder.

Why: the README promises any attention-cache ``AutoModelForCausalLM``. The lossless suites try a handful of
families; this sweep tries every entry of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, each built from its
own config class with random weights (2 layers, small widths, its defaults otherwise), saved with
``save_pretrained`` beside a byte-level tokenizer and loaded back through `Generator.from_pretrained`, as a user's
download would be. Each architecture ends in exactly one list:

* ``runs``: every speculative output equals plain decoding of the same model, token for token;
* ``refused``: loading or starting refused it with one line naming why (`LatticeError`: encoder-decoder,
  encoder-only, needs pixels or audio, a cache that cannot be rolled back);
* ``unbuildable``: the tiny model could not be built from its config class (the reason says what failed);
* ``failed``: anything else, a traceback or a speculative output that differs (a bug: the tests fail on it).

``fast`` checks greedy against ``ngram`` on one prompt; the full form adds ``suffix``, a seeded sample (plain and
``ngram``) and a batch of three through ``generate_many``, on grounded-style prompts.

Run ``python -m lattice_testing.arch_sweep [--full] [--only llama,gpt2]`` to print the three lists with
their counts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from lattice_inference.errors import LatticeError

Status = Literal["runs", "refused", "unbuildable", "failed"]
STATUSES: tuple[Status, ...] = ("runs", "refused", "unbuildable", "failed")

SWEEP_VOCAB = 512
"""Vocabulary of every tiny model: the byte tokenizer's 259 ids and room for the special ids configs name."""

NEW_TOKENS = 24
"""Tokens generated per prompt (the full form)."""

FAST_NEW_TOKENS = 16
"""Tokens generated in the fast form (its one prompt, greedy and ``ngram``)."""

MAX_PARAMETERS = 40_000_000
"""Largest tiny model built (a config whose small sizes still give more is listed as not buildable tiny)."""

# What every tiny config sets, by the names configs use (a config's ``attribute_map`` aliases are resolved first);
# a name a config does not have is not added.
SMALL: dict[str, object] = {
    "num_hidden_layers": 2,
    "num_layers": 2,
    "n_layers": 2,
    "decoder_layers": 2,
    "encoder_layers": 2,
    "num_decoder_layers": 2,
    "hidden_size": 64,
    "d_model": 64,
    "embed_dim": 64,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "d_ff": 128,
    "decoder_ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "ffn_hidden_size": 128,
    "num_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": SWEEP_VOCAB,
    "moe_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "sliding_window": 32,
    "state_size": 8,
    "ssm_state_size": 8,
    "mamba_d_state": 8,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "time_step_rank": 8,
    "num_key_value_groups": 1,
    "projector_hidden_size": 64,
    "text_hidden_size": 64,
    "vision_hidden_size": 64,
    "image_size": 32,
    "patch_size": 8,
    "rotary_dim": 8,
    "d_head": 16,
    "embedding_dim": 64,
    "vocab_size_per_layer_input": SWEEP_VOCAB,
    "hidden_size_per_layer_input": 16,
    "global_head_dim": 16,
    "encoder_hash_byte_group_vocab": 1024,
}

FILL_NONE = frozenset({"head_dim", "num_key_value_heads", "moe_intermediate_size", "num_experts_per_tok", "d_head"})
"""`SMALL` names set even where the default config leaves them None (models that need them to build)."""

MIN_POSITIONS = 512
"""Fewest positions a tiny model gets (`PROMPTS` and `NEW_TOKENS` fit): a default below it is raised to it."""

OVERRIDES: dict[str, dict[str, object]] = {
    "zaya": {"num_experts_per_tok": 1},  # its config supports one expert per token only
}
"""Values a config class needs beyond `SMALL` to build tiny."""

SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "sep_token_id")

PROMPTS = (
    "Document: The river rises in the north hills and runs south past the mill. The mill grinds corn. "
    "Question: what does the mill grind? Answer: The mill grinds",
    "def area(width, height):\n    return width * height\n\n# Rewrite area to check its inputs.\n"
    "def area(width, height):\n",
    'Notes: alpha=3, beta=5, gamma=8. Extract the values as JSON: {"alpha": 3, "beta": ',
)


@dataclass
class SweepResult:
    """One architecture's outcome: its list (`Status`), a one-line reason, the checks that ran and the seconds."""

    model_type: str
    status: Status
    reason: str = ""
    checks: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        """One printable line."""
        detail = self.reason or ", ".join(self.checks)
        return f"{self.model_type:28} {detail}"


class CannotBuildTiny(Exception):
    """The tiny model of an architecture could not be built (the message says why)."""


def causal_lm_types() -> list[str]:
    """Every model type of the installed transformers' causal-LM mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _shrink(values: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """``values`` (a config's ``to_dict``) with `SMALL` sizes applied to the keys it has (through ``aliases``, the
    config class's ``attribute_map``), per-layer lists cut to two layers (first and last entry, so a pattern of
    sliding and full attention keeps both), special token ids moved inside `SWEEP_VOCAB`."""
    out = dict(values)
    layers_key = aliases.get("num_hidden_layers", "num_hidden_layers")
    layers = out.get(layers_key)
    for name, small in SMALL.items():
        key = aliases.get(name, name)
        if key not in out or (out[key] is None and name not in FILL_NONE):
            continue
        current = out[key]
        if current is not None and (isinstance(current, bool) or not isinstance(current, int | float)):
            continue
        out[key] = small if name != "sliding_window" else min(int(current), int(small))  # type: ignore[call-overload]
    if isinstance(out.get("qk_rope_head_dim"), int):  # multi-head latent attention: keys and values per head
        if "head_dim" in out:
            out["head_dim"] = out["qk_rope_head_dim"]  # its rotary part
        if "num_key_value_heads" in out:
            out["num_key_value_heads"] = out.get("num_attention_heads", 4)
    positions = aliases.get("max_position_embeddings", "max_position_embeddings")
    if isinstance(out.get(positions), int) and out[positions] < MIN_POSITIONS:
        out[positions] = MIN_POSITIONS
    for key, value in list(out.items()):
        if isinstance(layers, int) and isinstance(value, list) and len(value) == layers and layers > 2:
            out[key] = [value[0], value[-1]]
        elif key.endswith("token_id") or key.endswith("token_index") or key in SPECIAL_ID_KEYS:
            if isinstance(value, int) and not isinstance(value, bool) and value >= 256:
                out[key] = 256 + (value % 3) if key in SPECIAL_ID_KEYS else 300 + value % 200
            elif isinstance(value, list):
                out[key] = [256 + v % 3 if isinstance(v, int) and v >= 256 else v for v in value]
    return out


def tiny_config(model_type: str) -> Any:
    """The tiny config of ``model_type``: its config class's defaults, `_shrink` applied to it and to each of its
    sub-configs (``text_config``, ``vision_config``, ...)."""
    from transformers import CONFIG_MAPPING, PretrainedConfig

    try:
        cls = CONFIG_MAPPING[model_type]
        base = cls()
    except Exception as exc:
        raise CannotBuildTiny(f"its config class has no usable defaults: {_first_line(exc)}") from exc

    def aliases_of(values: dict[str, Any]) -> dict[str, str]:
        kind = values.get("model_type")
        owner = CONFIG_MAPPING[kind] if isinstance(kind, str) and kind in CONFIG_MAPPING else None
        return dict(getattr(owner, "attribute_map", {}) or {})

    def shrunk(values: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
        layers = values.get(aliases.get("num_hidden_layers", "num_hidden_layers"))
        out = _shrink(values, aliases)
        for key, value in out.items():
            if key in ("id2label", "label2id") or not isinstance(value, dict):
                continue
            if key == "per_layer_config" and isinstance(layers, int):  # {layer index: its own sizes}
                kept = {0: 0, layers - 1: 1}
                out[key] = {str(kept[int(k)]): shrunk(v, aliases) for k, v in value.items() if int(k) in kept}
            else:
                out[key] = shrunk(value, aliases_of(value) if "model_type" in value else {})
        return out

    if not isinstance(base, PretrainedConfig):
        raise CannotBuildTiny("its config class gives no config")
    values = {**shrunk(base.to_dict(), dict(getattr(cls, "attribute_map", {}) or {})), **OVERRIDES.get(model_type, {})}
    values.pop("model_type", None)
    values.pop("transformers_version", None)
    try:
        config = cls(**values)
    except Exception as exc:
        raise CannotBuildTiny(f"its config rejects small sizes: {_first_line(exc)}") from exc
    config.tie_word_embeddings = bool(getattr(base, "tie_word_embeddings", False))
    return config


def save_tiny_model(model_type: str, path: Path, *, seed: int = 0) -> Path:
    """Build ``model_type``'s tiny random model (`tiny_config`, float32, transformers' own init with std 0.02: a
    small init loops, which prompt lookup drafts) and write it with the byte tokenizer to ``path``."""
    from transformers import AutoModelForCausalLM

    from lattice_testing.toy import byte_tokenizer

    config = tiny_config(model_type)
    if hasattr(config, "initializer_range"):
        config.initializer_range = 0.02
    try:
        with torch.device("meta"):
            shape = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        size = sum(p.numel() for p in shape.parameters())
        if size > MAX_PARAMETERS:
            raise CannotBuildTiny(f"its smallest model built here has {size / 1e6:.0f}M parameters")
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except CannotBuildTiny:
        raise
    except Exception as exc:
        if not _defaults_build(model_type):
            raise CannotBuildTiny(f"its config class's defaults build no model either: {_first_line(exc)}") from exc
        raise CannotBuildTiny(f"its model cannot be built from the tiny config: {_first_line(exc)}") from exc
    tokenizer = byte_tokenizer()
    eos = tokenizer.eos_token_id
    try:
        model.generation_config.eos_token_id = eos
        model.generation_config.pad_token_id = eos
        model.save_pretrained(path)
    except Exception as exc:
        raise CannotBuildTiny(f"its tiny model cannot be saved: {_first_line(exc)}") from exc
    tokenizer.save_pretrained(path)
    return path


def _defaults_build(model_type: str) -> bool:
    """Whether ``model_type``'s config class, at its own defaults, builds a model (on ``meta``: no memory)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type]())
    except Exception:
        return False
    return True


def _first_line(exc: BaseException) -> str:
    """``Type: message`` on one line (a first line ending in a colon takes the next, where validators put why)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    text = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return f"{type(exc).__name__}: {text[:200]}"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence transformers' and Python's warnings and prints while one architecture runs."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            logging.disable(logging.WARNING)
            yield
    finally:
        logging.disable(logging.NOTSET)
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


TOKEN_BY_TOKEN = "self-check NOT exact: verified token by token"
TREES_OFF = "self-check NOT exact in a draft tree: chains only"


def _check(generator_for: Callable[..., Any], full: bool) -> list[str]:
    """Run the checks on a loaded architecture; returns the names of those that passed, raises AssertionError
    naming the first speculative output that differs from plain decoding."""
    greedy = generator_for("greedy")
    ngram = generator_for("ngram")
    prompts = PROMPTS if full else PROMPTS[:1]
    budget = NEW_TOKENS if full else FAST_NEW_TOKENS
    done = []
    plain = [greedy.generate(p, budget).token_ids for p in prompts]
    for i, p in enumerate(prompts):
        got = ngram.generate(p, budget).token_ids
        if got != plain[i]:
            raise AssertionError(f"ngram differs from greedy on prompt {i}: {got} != {plain[i]}")
    done.append("greedy=ngram")
    check = ngram.decoder.exactness
    if check is not None and not check.exact:
        done.append(TREES_OFF if check.chains_exact else TOKEN_BY_TOKEN)
    if not full:
        return done
    suffix = generator_for("suffix")
    for _ in range(2):  # the second pass drafts from the first's outputs in the suffix index
        for i, p in enumerate(prompts):
            got = suffix.generate(p, NEW_TOKENS).token_ids
            if got != plain[i]:
                raise AssertionError(f"suffix differs from greedy on prompt {i}: {got} != {plain[i]}")
    done.append("suffix")
    sample = dict(temperature=0.8, top_p=0.95, seed=1234)
    sampled = [greedy.generate(p, NEW_TOKENS, **sample).token_ids for p in prompts]
    for i, p in enumerate(prompts):
        got = ngram.generate(p, NEW_TOKENS, **sample).token_ids
        if got != sampled[i]:
            raise AssertionError(f"seeded ngram sample differs on prompt {i}: {got} != {sampled[i]}")
    done.append("sampled")
    batch = [r.token_ids for r in ngram.generate_many(list(prompts), NEW_TOKENS)]
    if batch != plain:
        raise AssertionError(f"a batch of {len(prompts)} differs from each prompt alone")
    done.append("batch")
    return done


def run_architecture(model_type: str, *, full: bool = False, workdir: Path | None = None) -> SweepResult:
    """Build, save, load and check one architecture (see the module docstring); never raises."""
    from lattice_inference.api import Generator

    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        root = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"sweep-{model_type}-")))
        path = root / model_type
        result: SweepResult
        with _quiet():
            try:
                save_tiny_model(model_type, path)
            except CannotBuildTiny as exc:
                result = SweepResult(model_type, "unbuildable", str(exc))
            except Exception as exc:
                result = SweepResult(model_type, "unbuildable", f"building it raised {_first_line(exc)}")
            else:
                loaded: dict[str, Any] = {}

                def generator_for(method: str) -> Any:
                    if "model" not in loaded:
                        first = Generator.from_pretrained(str(path), device="cpu", method=method, adaptive=False)
                        loaded["model"], loaded["tokenizer"] = first.model, first.tokenizer
                        loaded["target"] = first.decoder.target
                        return first
                    return Generator(
                        loaded["model"], loaded["tokenizer"], method=method, adaptive=False, target=loaded["target"]
                    )

                try:
                    checks = _check(generator_for, full)
                    result = SweepResult(model_type, "runs", checks=checks)
                except LatticeError as exc:
                    text = str(exc)
                    if "\n" in text.strip():
                        result = SweepResult(model_type, "failed", f"a refusal of several lines: {text[:200]!r}")
                    else:
                        result = SweepResult(model_type, "refused", text)
                except AssertionError as exc:
                    result = SweepResult(model_type, "failed", f"not lossless: {str(exc)[:300]}")
                except Exception as exc:
                    where = traceback.extract_tb(exc.__traceback__)[-1]
                    result = SweepResult(
                        model_type,
                        "failed",
                        f"{_first_line(exc)} (at {Path(where.filename).name}:{where.lineno})",
                    )
    result.seconds = time.perf_counter() - start
    return result


def sweep(model_types: Iterable[str] | None = None, *, full: bool = False) -> list[SweepResult]:
    """`run_architecture` over ``model_types`` (default: `causal_lm_types`)."""
    return [run_architecture(t, full=full) for t in (model_types or causal_lm_types())]


def report(results: Sequence[SweepResult]) -> str:
    """The three lists (and failures, if any) with their counts, as the sweep prints them."""
    lines = []
    for status in STATUSES:
        chosen = [r for r in results if r.status == status]
        if status == "failed" and not chosen:
            continue
        lines.append(f"{status}: {len(chosen)}")
        lines.extend(f"  {r.line()}" for r in chosen)
    return "\n".join(lines)


REFUSAL_KINDS = (
    ("recurrent-state cache", "recurrent state (linear attention, state space) that cropping a cache cannot roll back"),
    ("outside an attention cache", "state kept outside an attention cache (no `cache` argument)"),
    ("attends to later tokens", "an encoder: rows see later tokens"),
    ("several new tokens", "a cache that cannot take several new rows (what verifying a draft feeds)"),
    ("token ids alone", "fails on token ids alone"),
    ("DynamicCache cannot build", "a cache layout transformers' `DynamicCache` cannot build"),
    ("is not supported:", "by name (`REFUSED_FAMILIES`), a cache whose extra state cropping cannot roll back"),
)
"""Refusal reasons as the README groups them: a phrase of the one-line error, and what it means."""


def markdown(results: Sequence[SweepResult]) -> str:
    """The README's sweep block: each list's count and names, refusals grouped by reason, each unbuildable's reason
    (``python -m lattice_testing.arch_sweep --markdown`` prints it; a test compares it with README)."""
    lines = ["<!-- sweep:start -->"]
    for status in ("runs", "refused", "unbuildable"):
        names = sorted(r.model_type for r in results if r.status == status)
        lines.append(f"- **{status}** ({len(names)}): " + ", ".join(f"`{n}`" for n in names))
    refused = [r for r in results if r.status == "refused"]
    groups = [
        (meaning, sorted(r.model_type for r in refused if phrase in r.reason)) for phrase, meaning in REFUSAL_KINDS
    ]
    lines.append("  - refused: " + "; ".join(f"{meaning}: {', '.join(names)}" for meaning, names in groups if names))
    alone = sorted(r.model_type for r in results if r.status == "runs" and TOKEN_BY_TOKEN in r.checks)
    if alone:
        lines.append(
            "  - run, verifying one token at a time (their self-check found rows that differ from 1-token steps: "
            "attention or products computed outside what decode matching routes; lossless, no speed-up): "
            + ", ".join(alone)
        )
    chains = sorted(r.model_type for r in results if r.status == "runs" and TREES_OFF in r.checks)
    if chains:
        lines.append(
            "  - run without draft trees (a tree's rows differ: positions computed by the model, not taken from "
            "position_ids): " + ", ".join(chains)
        )
    unbuildable = sorted((r for r in results if r.status == "unbuildable"), key=lambda r: r.model_type)
    if unbuildable:
        lines.append("  - not built tiny: " + "; ".join(f"{r.model_type} ({_short(r.reason)})" for r in unbuildable))
    lines.append("<!-- sweep:end -->")
    return "\n".join(lines)


def _short(reason: str) -> str:
    """An unbuildable architecture's reason cut for the README (no backticks, at most 90 characters)."""
    text = reason.replace("`", "").replace("its model cannot be built from the tiny config: ", "")
    text = text.replace("StrictDataclassClassValidationError: Class validation error for validator ", "")
    return text if len(text) <= 90 else text[:87] + "..."


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: run the sweep and print its lists; ``--json FILE`` also writes every result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="every check (default: greedy against ngram)")
    parser.add_argument("--only", default="", help="comma-separated model types (default: the whole mapping)")
    parser.add_argument("--json", default="", help="write the results to this file too")
    parser.add_argument("--markdown", action="store_true", help="also print README's sweep block")
    args = parser.parse_args(argv)
    types = [t for t in args.only.split(",") if t] or causal_lm_types()
    results = []
    for t in types:
        r = run_architecture(t, full=args.full)
        print(f"[{r.status}] {r.line()} ({r.seconds:.1f} s)", flush=True)
        results.append(r)
        if args.json:
            Path(args.json).write_text(json.dumps([vars(x) for x in results], indent=1))
    print(report(results))
    if args.markdown:
        print(markdown(results))


if __name__ == "__main__":
    main()
