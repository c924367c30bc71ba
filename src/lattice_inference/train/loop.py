"""The MTP training loop: AdamW on the head only, progress line, held-out acceptance probe, checkpoints, resume.

The loss is cross-entropy over the draft vocabulary (token ids below ``draft_vocab``; rows whose label lies
outside it are skipped, since such a head can never draft them), summed over the chained draft steps trained
(`LoopConfig.depth`). The probe is the share of held-out rows where the head's draft-vocabulary argmax equals
the target's own next token (the first draft's acceptance rate under greedy decoding), and the share where the
first two chained drafts both do. Ctrl-C (SIGINT) and SIGTERM finish the current step, then checkpoint and
export; SIGSTOP / SIGCONT (other jobs pausing this one) only pause it.
"""

from __future__ import annotations

import math
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lattice_inference.mtp.head_file import write_atomic
from lattice_inference.train.data import ShardCache
from lattice_inference.train.model import TrainableHead


@dataclass
class LoopConfig:
    """Optimisation settings of one run."""

    steps: int = 1000
    batch: int = 8
    lr: float = 1e-3
    warmup: int = 30
    draft_vocab: int | None = None
    build_every: int = 2
    """Compute one new shard of trunk states every this many steps until all are cached."""
    log_every_s: float = 10.0
    probe_every_s: float = 300.0
    checkpoint_every_s: float = 300.0
    seed: int = 0
    soft_weight: float = 0.0
    """Share of the loss that is KL to the target's next-token distribution (see `head_loss`)."""
    depth: int = 1
    """Chained draft steps trained (see `TrainableHead.forward_chain`)."""


@dataclass
class LoopState:
    """What a checkpoint restores besides the weights."""

    step: int = 0
    tokens: int = 0
    elapsed: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)


def lr_at(cfg: LoopConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak at ``cfg.steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def head_loss(
    head: TrainableHead,
    rows: dict[str, torch.Tensor],
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    vocab: int,
    soft_weight: float = 0.0,
    depth: int = 1,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """``(losses, correct, valid [B, n])`` of one batch of training rows over the first ``vocab`` ids, for draft
    steps ``1..depth`` chained as drafting chains them (`TrainableHead.forward_chain`); ``losses[j]`` is step
    ``j``'s loss (training minimises their sum) and ``correct[j]``
    ``[B, n - j]`` marks where step ``j``'s argmax is the target's token, indexed by the chain's first row.

    Step 1's loss is ``(1 - soft_weight) * CE(target's argmax) + soft_weight * KL(target || head)``, the KL over
    the draft vocabulary with the target's own distribution at the next position (``lm_head(h_{t+1})``, the next
    row's hidden; a window's last row has none and counts in the cross-entropy only). The soft term gives every
    row the target's whole ranking, not one token, and is the quantity sampled verification accepts by. Later
    steps add their cross-entropy with weight 1: a second draft is worth as much as the first once the first is
    accepted, and training on the head's own hiddens is what makes it acceptable (EAGLE-3)."""
    rows = {k: v.to(embed.device) for k, v in rows.items()}  # shards live on the CPU; the target may not
    outs = head.forward_chain(rows["hidden"], rows["tokens"].long(), embed, depth)
    labels = rows["labels"].long()
    losses: list[torch.Tensor] = []
    correct: list[torch.Tensor] = []
    for j, out in enumerate(outs):
        logits = F.linear(out, lm_head[:vocab]).float()
        lab = labels[:, j:]
        valid = lab < vocab
        ce = F.cross_entropy(logits[valid], lab[valid]) if bool(valid.any()) else logits.sum() * 0
        if j == 0 and soft_weight > 0 and logits.shape[1] > 1:
            with torch.no_grad():
                teacher = F.linear(rows["hidden"][:, 1:].to(lm_head.dtype), lm_head[:vocab]).float().log_softmax(-1)
            student = logits[:, :-1].log_softmax(-1)
            kl = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1).mean()
            ce = (1 - soft_weight) * ce + soft_weight * kl
        losses.append(ce)
        correct.append((logits.argmax(-1) == lab) & valid)
    return losses, correct, labels < vocab


@torch.no_grad()
def probe(
    head: TrainableHead, held: dict[str, torch.Tensor], embed: torch.Tensor, lm_head: torch.Tensor, vocab: int
) -> dict[str, float]:
    """Held-out loss of the first draft step, its acceptance (share of all rows, out-of-vocabulary labels
    counting as misses) and ``acceptance_2``, the share of rows where the first two chained drafts are both
    right: with draft length 3 a greedy round accepts ``acceptance + acceptance_2`` drafts on average."""
    losses, first, both, total, chains = [], 0, 0, 0, 0
    for i in range(0, held["tokens"].shape[0], 4):
        rows = {k: v[i : i + 4] for k, v in held.items()}
        step_losses, ok, _ = head_loss(head, rows, embed, lm_head, vocab, depth=2)
        losses.append(float(step_losses[0]))
        first += int(ok[0].sum())
        total += ok[0].numel()
        if len(ok) > 1:
            both += int((ok[0][:, :-1] & ok[1]).sum())
            chains += ok[1].numel()
    return {
        "heldout_loss": sum(losses) / len(losses),
        "acceptance": first / max(1, total),
        "acceptance_2": both / max(1, chains),
    }


class _Stop:
    """Turns SIGINT/SIGTERM into a flag the loop checks between steps."""

    def __init__(self) -> None:
        self.requested = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Stop:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def save_checkpoint(path: Path, head: TrainableHead, opt: torch.optim.Optimizer, state: LoopState) -> None:
    """Weights, optimiser and loop state, written atomically."""
    blob = {"head": head.state_dict(), "opt": opt.state_dict(), "state": state.__dict__}
    write_atomic(path, lambda tmp: torch.save(blob, tmp))


def _resumed(
    head: TrainableHead, opt: torch.optim.Optimizer, checkpoint: Path, device: torch.device, log: Callable[[str], None]
) -> LoopState:
    """The state a checkpoint holds, its head's and optimizer's states loaded."""
    blob = torch.load(checkpoint, weights_only=False, map_location=device)
    head.load_state_dict(blob["head"])
    opt.load_state_dict(blob["opt"])
    state = LoopState(**blob["state"])
    log(f"resumed at step {state.step} ({state.tokens / 1e6:.2f}M tokens)")
    return state


def _step(
    head: TrainableHead,
    opt: torch.optim.Optimizer,
    rows: dict[str, torch.Tensor],
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    vocab: int,
    cfg: LoopConfig,
    lr: float,
) -> tuple[float, int]:
    """One optimizer step at learning rate ``lr`` on a batch of cached trunk ``rows``: its loss and the tokens it
    trained on."""
    for group in opt.param_groups:
        group["lr"] = lr
    step_losses, _, valid = head_loss(head, rows, embed, lm_head, vocab, cfg.soft_weight, cfg.depth)
    loss = torch.stack(step_losses).sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    opt.step()
    return loss.item(), int(valid.numel())


def train(
    head: TrainableHead,
    cache: ShardCache,
    held: dict[str, torch.Tensor],
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    cfg: LoopConfig,
    *,
    checkpoint: Path,
    resume: bool,
    on_checkpoint: Callable[[LoopState], None],
    log: Callable[[str], None],
) -> LoopState:
    """Train ``head`` for ``cfg.steps`` steps (continuing a checkpoint when ``resume``); returns the final state."""
    vocab = cfg.draft_vocab or int(lm_head.shape[0])
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state = _resumed(head, opt, checkpoint, embed.device, log) if resume and checkpoint.is_file() else LoopState()
    rng = random.Random(cfg.seed * 1_000_003 + state.step)
    built = len(cache.ready())
    if built == 0:
        cache.ensure(0)
    t0 = time.monotonic() - state.elapsed
    last_log = last_probe = last_ckpt = time.monotonic()
    win_tokens, win_loss, win_n = 0, 0.0, 0
    tty = sys.stderr.isatty()

    def snapshot(final: bool = False) -> None:
        state.elapsed = time.monotonic() - t0
        state.history.append({"step": state.step, "tokens": state.tokens, **probe(head, held, embed, lm_head, vocab)})
        save_checkpoint(checkpoint, head, opt, state)
        on_checkpoint(state)
        h = state.history[-1]
        log(
            f"{'final' if final else 'checkpoint'} step {state.step}: held-out loss {h['heldout_loss']:.3f}, "
            f"acceptance {h['acceptance']:.3f} (two drafts {h['acceptance_2']:.3f})"
        )

    if not state.history:  # the warm start's figures, for comparison
        state.history.append({"step": 0, "tokens": 0, **probe(head, held, embed, lm_head, vocab)})
        first = state.history[0]
        log(
            f"at init: held-out loss {first['heldout_loss']:.3f}, acceptance {first['acceptance']:.3f} "
            f"(two drafts {first['acceptance_2']:.3f})"
        )
    with _Stop() as stop:
        while state.step < cfg.steps and not stop.requested:
            ready = cache.ready()
            if len(ready) < cache.count and state.step % cfg.build_every == 0:
                cache.ensure(len(ready))
            lr = lr_at(cfg, state.step)
            loss, tokens = _step(head, opt, cache.sample(rng, cfg.batch), embed, lm_head, vocab, cfg, lr)
            state.step += 1
            state.tokens += tokens
            win_tokens += tokens
            win_loss, win_n = win_loss + loss, win_n + 1
            now = time.monotonic()
            if now - last_log >= cfg.log_every_s or state.step == cfg.steps:
                acc = state.history[-1]["acceptance"] if state.history else float("nan")
                line = (
                    f"step {state.step}/{cfg.steps} loss {win_loss / win_n:.3f} lr {lr:.1e} "
                    f"{win_tokens / (now - last_log):.0f} tok/s shards {len(cache.ready())}/{cache.count} "
                    f"acceptance {acc:.3f} elapsed {(now - t0) / 60:.1f}m"
                )
                if tty:
                    print("\r" + line, end="", file=sys.stderr, flush=True)
                else:
                    log(line)
                last_log, win_tokens, win_loss, win_n = now, 0, 0.0, 0
            if now - last_probe >= cfg.probe_every_s or now - last_ckpt >= cfg.checkpoint_every_s:
                if tty:
                    print(file=sys.stderr)
                snapshot()
                last_probe = last_ckpt = time.monotonic()
        if stop.requested:
            log(f"stopping at step {state.step} (interrupted); writing a checkpoint")
        snapshot(final=True)
    return state
