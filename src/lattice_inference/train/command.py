"""``lattice train-mtp``: train one MTP head on a frozen target and write it where ``--mtp-head`` loads it.

Stages, each resumable from ``--out`` (intermediate files in its ``work`` subfolder): gather ``--data``; answer
the prompts with the target itself (``--self-distill``; cached as ``distill.jsonl``); pack documents into windows;
compute the trunk's states shard by shard while training (``shards``); train (``checkpoint.pt``); export
``mtp_head.safetensors`` + ``.json`` into ``--out`` at every checkpoint, so the newest head is always usable.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lattice_inference.errors import ConfigError
from lattice_inference.flags import add_placement_arguments

if TYPE_CHECKING:  # the parser is built on every `lattice` call: torch and transformers load only to train
    from lattice_inference.models.load import LoadedModel
    from lattice_inference.train.loop import LoopConfig


def add_parser(sub: argparse._SubParsersAction, positive_int: Callable[[str], int], model_help: str) -> None:
    """Add ``train-mtp`` to the ``lattice`` command's sub-parsers."""
    p = sub.add_parser(
        "train-mtp",
        help="train an MTP head for a model (then: --mtp-head OUT --method mtp)",
        description="Train one MTP layer on the frozen target's post-final-norm hidden states. The head uses the "
        "target's own embedding and lm_head (not stored). Writes OUT/mtp_head.safetensors + OUT/mtp_head.json at "
        "every checkpoint; Ctrl-C stops cleanly with a usable head; --resume continues.",
    )
    p.add_argument("--model", help=model_help)
    p.add_argument(
        "--data",
        nargs="+",
        required=True,
        help="text files or folders (.txt .md .rst .py), .jsonl of {text} or of prompts {prompt|messages}, "
        "'stdlib' (the Python standard library's sources) and/or 'prompts' (built-in chat prompts)",
    )
    p.add_argument("--out", required=True, help="output folder (head, card notes, work files)")
    p.add_argument("--steps", type=positive_int, default=1000, help="optimiser steps (default 1000)")
    p.add_argument("--tokens", type=positive_int, default=200_000, help="trunk-state tokens to cache (default 200k)")
    p.add_argument("--draft-vocab", type=positive_int, help="train and draft over token ids below N (default: all)")
    p.add_argument(
        "--self-distill", action="store_true", help="answer the prompts with the target (greedy) and train on that"
    )
    p.add_argument("--distill-tokens", type=positive_int, default=160, help="answer length for --self-distill")
    p.add_argument("--distill-batch", type=positive_int, default=16, help="prompts answered at once (default 16)")
    p.add_argument("--num-prompts", type=positive_int, default=320, help="built-in prompts to use (default 320)")
    p.add_argument("--seq-len", type=positive_int, default=256, help="window length (default 256)")
    p.add_argument("--batch", type=positive_int, default=8, help="windows per step (default 8)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument(
        "--soft-weight",
        type=float,
        default=0.0,
        help="share of the loss that is KL to the target's next-token distribution, the rest cross-entropy on "
        "its argmax (default 0)",
    )
    p.add_argument(
        "--draft-steps",
        type=positive_int,
        default=2,
        help="chained draft steps trained: step 2 drafts from the head's own hidden, as drafting does (default 2)",
    )
    p.add_argument(
        "--init-head",
        metavar="PATH",
        help="start from this saved head (file or folder; 'shipped' for the model's packaged head) instead of the "
        "target's last layer: fine-tune a head on your own data. Its draft vocabulary is kept unless "
        "--draft-vocab is given",
    )
    p.add_argument("--checkpoint-minutes", type=float, default=5.0, help="checkpoint + probe interval (default 5)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    add_placement_arguments(p, dtype_default="float32")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0, help="data order and initialisation seed")


def log(msg: str) -> None:
    """A timestamped progress line on stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _documents(args: argparse.Namespace, loaded: LoadedModel, work: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of the training and held-out documents (self-distilled chats first, then text up to --tokens)."""
    from lattice_inference.train import data as datamod

    tok, model = loaded.tokenizer, loaded.model
    sources = datamod.gather(args.data, num_prompts=args.num_prompts, seed=args.seed)
    log(f"data: {len(sources.texts)} documents, {len(sources.prompts)} prompts")
    docs: list[list[int]] = []
    if sources.prompts:
        if args.self_distill:
            docs += datamod.self_distill(
                model,
                tok,
                sources.prompts,
                max_new_tokens=args.distill_tokens,
                batch_size=args.distill_batch,
                cache=work / "distill.jsonl",
                log=log,
            )
        else:
            docs += [tok.apply_chat_template(m, tokenize=True, return_dict=False) for m in sources.prompts]
    rng = random.Random(args.seed)
    texts = list(sources.texts)
    rng.shuffle(texts)
    have = sum(map(len, docs))
    for text in texts:
        if have >= args.tokens * 1.1:
            break
        ids = tok(text[:20_000], add_special_tokens=False).input_ids
        docs.append(ids)
        have += len(ids)
    train_docs = [d for i, d in enumerate(docs) if not datamod.is_held_out(i, args.seed)]
    held_docs = [d for i, d in enumerate(docs) if datamod.is_held_out(i, args.seed)]
    return train_docs, held_docs


def _init_head(args: argparse.Namespace, source: str, config: Any, cfg: Any) -> tuple[dict, dict]:
    """The tensors and JSON config of ``--init-head`` (``shipped``: the model's packaged head), checked to fit."""
    from lattice_inference.mtp.head_file import read_head_tensors, shipped_head

    path = args.init_head
    if path == "shipped":
        path = shipped_head(source)
        if path is None:
            raise ConfigError(f"--init-head shipped: no head ships with {source}; give a head's path")
    return read_head_tensors(path, config, cfg)


def _check_run(args: argparse.Namespace, out: Path, work: Path) -> None:
    """Refuse a soft-target weight outside [0, 1], and an ``--out`` holding a run unless ``--resume``."""
    if not 0.0 <= args.soft_weight <= 1.0:
        raise ConfigError(f"--soft-weight must lie in [0, 1], got {args.soft_weight}")
    if work.exists() and not args.resume and (work / "checkpoint.pt").exists():
        raise ConfigError(f"{out} already holds a run: pass --resume to continue it, or choose another --out")


def _loop_config(args: argparse.Namespace) -> LoopConfig:
    """The training loop's settings from ``lattice train-mtp``'s arguments."""
    from lattice_inference.train.loop import LoopConfig

    return LoopConfig(
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        draft_vocab=args.draft_vocab,
        probe_every_s=args.checkpoint_minutes * 60,
        checkpoint_every_s=args.checkpoint_minutes * 60,
        seed=args.seed,
        soft_weight=args.soft_weight,
        depth=args.draft_steps,
    )


def run(args: argparse.Namespace) -> int:
    """Run ``lattice train-mtp``; returns the exit code."""
    import torch

    from lattice_inference.models.load import load_model
    from lattice_inference.mtp.head_file import config_for_target
    from lattice_inference.train import data as datamod
    from lattice_inference.train.export import export_head
    from lattice_inference.train.loop import LoopState, train
    from lattice_inference.train.model import TrainableHead

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    work = out / "work"
    _check_run(args, out, work)
    work.mkdir(parents=True, exist_ok=True)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    model = loaded.model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    embed = model.get_input_embeddings().weight
    lm_head = model.get_output_embeddings().weight
    vocab = int(lm_head.shape[0])
    if args.draft_vocab is not None and args.draft_vocab > vocab:
        raise ConfigError(f"--draft-vocab {args.draft_vocab} is larger than the model's vocabulary ({vocab})")
    cfg = config_for_target(model.config)
    init = _init_head(args, loaded.source, model.config, cfg) if args.init_head else None
    if init is not None and args.draft_vocab is None:
        args.draft_vocab = init[1].get("draft_vocab")
    train_docs, held_docs = _documents(args, loaded, work)
    sep = loaded.eos_token_ids[0] if loaded.eos_token_ids else 0
    windows = datamod.pack(train_docs, args.seq_len, sep, budget=args.tokens)
    random.Random(args.seed).shuffle(windows)
    held_windows = datamod.pack(held_docs, args.seq_len, sep)[:16] or windows[-4:]
    if not windows:
        raise ConfigError(f"--data gives fewer than {args.seq_len + 1} tokens: nothing to train on")
    log(f"{len(windows)} training windows of {args.seq_len + 1} tokens, {len(held_windows)} held out")
    held = datamod.trunk_rows(model, torch.tensor(held_windows))
    cache = datamod.ShardCache(work / "shards", windows, max(1, args.batch), model)
    head = TrainableHead(cfg)
    if init is not None:
        head.init_from_tensors(init[0], str(args.init_head))
    else:
        head.init_from_target(model)
    head.to(embed.device)
    notes = {
        "model": loaded.source,
        "data": list(args.data),
        "self_distill": bool(args.self_distill),
        "windows": len(windows),
        "seq_len": args.seq_len,
        "init_head": args.init_head,
        "command": " ".join(sys.argv[1:]),
    }

    def exported(state: LoopState) -> None:
        last = state.history[-1] if state.history else {}
        report = {**notes, "steps": state.step, "tokens": state.tokens, "minutes": round(state.elapsed / 60, 1)}
        report |= {k: round(v, 4) for k, v in last.items() if isinstance(v, float)}
        export_head(head, model.config, out, draft_vocab=args.draft_vocab, training=report)
        (out / "training_log.json").write_text(json.dumps({**report, "history": state.history}, indent=1) + "\n")

    loop = _loop_config(args)
    state = train(
        head,
        cache,
        held,
        embed,
        lm_head,
        loop,
        checkpoint=work / "checkpoint.pt",
        resume=args.resume,
        on_checkpoint=exported,
        log=log,
    )
    log(f"done: {state.step} steps; head in {out}")
    return 0
