#!/usr/bin/env python
"""Train the shipped default model: a tiny Qwen3.5 (``qwen3_5_text``) hybrid on the Python stdlib, plus an MTP head.

Everything is reproducible from ``--seed`` (data sampling is keyed by ``(seed, step)``, so ``--resume`` continues the
same stream). Stages (``--stage all`` runs them in order, skipping finished ones):

1. ``tokenizer``: byte-level BPE (``tokenizers``, vocab 4096) on the stdlib ``*.py`` files of the running interpreter
   (``sysconfig.get_paths()["stdlib"]``, without ``site-packages`` and test folders); a fixed ~2 % of the files
   (seeded hash of the relative path) is held out for evaluation. Saved as a transformers tokenizer.
2. ``trunk``: the causal LM, trained on a mixture in which repeated spans are a large share ("excerpt, separator,
   the excerpt again, possibly lightly edited", in-file repeats, plain file text). Every ``--eval-every-min``
   minutes it prints held-out losses and a free-running greedy copy probe on held-out files (copy rate and the
   4-gram repetition rate of the outputs); it stops at ``--trunk-minutes`` or once the copy probe reaches
   ``--target-copy`` (then it runs a short learning-rate decay first).
3. ``mtp``: with the trunk frozen, one MTP head in the Qwen3.5 ``mtp.*`` layout, trained by the package trainer
   (``lattice_inference.train``, the engine of ``lattice train-mtp``) teacher-forced to predict the trunk's own
   choice of ``x_{t+2}`` from its post-final-norm hidden ``h_t`` and the embedding of ``x_{t+1}``; the trainer runs
   the drafting head's own layer function (``lattice_inference.mtp.layer``; checked again at export).
   (The shipped head was trained by this script's earlier in-file copy of that function, on text labels.)
4. ``export``: bfloat16 ``model.safetensors`` (trunk + ``mtp.*``), config, generation config, tokenizer,
   ``eval_prompts.jsonl`` and ``training_report.json``; then checks that ``AutoModelForCausalLM`` loads the trunk and
   that ``load_mtp_head`` reproduces the training module's logits.

Run on this 2-core CPU (background, low priority)::

    nohup nice -n 19 .venv/bin/python tools/train_default_model.py --workdir train-run \
        --export-dir src/lattice_inference/default_model > train-run.log 2>&1 &

Add ``--resume`` to continue after an interruption. With a GPU, ``--device cuda`` and larger ``--hidden`` /
``--layers`` train a bigger model with the same recipe.

The defaults are the recipe the shipped model ended with, as one command: synthetic copy documents (random
identifiers, a separator, the same again) from step 0 at share 0.5, falling to 0.3 at step 1600 and 0.15 at step
3250, so induction (copying) emerges early; 60 % of the remaining documents are "excerpt, separator, excerpt"; the
learning rate decays linearly over the last 45 % of the time budget. The shipped weights themselves came from the
sequence of resumed commands recorded in ``training_report.json`` (``commands``): early runs had no synthetic
documents, and copying only emerged once they were added. One seed gives one data stream (batches are keyed by
``(seed, step)``); budgets are wall-clock minutes, so a faster machine trains more steps in the same budget
(``--max-steps`` fixes the count instead).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shlex
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # the package trainer runs the MTP stage

EOS = "<|endoftext|>"
SPECIALS = [EOS, "<|im_start|>", "<|im_end|>"]
#: Canonical separator between an excerpt and its repetition (used by the copy probe and the eval prompts).
SEP = "\n# ---- copy ----\n"
#: Other separators seen in training, so copying does not hinge on one marker.
ALT_SEPS = ["\n\n", "\n# again\n", "\n\n# " + "-" * 20 + "\n", "\n# ---- repeat ----\n"]
TEST_DIRS = {"test", "tests", "idle_test", "testing", "unittests"}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


# ============================================================================================ corpus


def stdlib_files() -> tuple[Path, list[str]]:
    """Root of the stdlib and the sorted relative paths of its ``*.py`` files (no site-packages, no tests)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        parts = rel.parts
        if parts[0] in ("site-packages", "dist-packages") or any(p in TEST_DIRS for p in parts[:-1]):
            continue
        if parts[0].startswith("config-"):
            continue
        rels.append(rel.as_posix())
    return root, sorted(rels)


def is_held_out(rel: str, seed: int, fraction: float = 0.02) -> bool:
    digest = hashlib.sha256(f"lattice-heldout:{seed}:{rel}".encode()).hexdigest()
    return int(digest[:8], 16) < fraction * 16**8


class Corpus:
    """Train / held-out file texts (lines right-stripped, tabs kept) and line-window sampling."""

    def __init__(self, seed: int) -> None:
        self.root, rels = stdlib_files()
        self.train: list[tuple[str, list[str]]] = []
        self.held: list[tuple[str, list[str]]] = []
        for rel in rels:
            try:
                text = (self.root / rel).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            lines = [ln.rstrip() for ln in text.splitlines()]
            if len(lines) < 8:
                continue
            (self.held if is_held_out(rel, seed) else self.train).append((rel, lines))
        sizes = np.array([sum(len(x) + 1 for x in lines) for _, lines in self.train], dtype=np.float64)
        self.weights = sizes / sizes.sum()
        self.identifiers: list[str] = sorted(
            {
                w
                for _, lines in self.train[:200]
                for ln in lines[:200]
                for w in re.findall(r"\b[a-z_][a-z0-9_]{2,11}\b", ln)
            }
        )

    def train_texts(self) -> list[str]:
        return ["\n".join(lines) + "\n" for _, lines in self.train]

    def window(
        self, rng: np.random.Generator, n_chars: int, held: bool = False, nonblank_start: bool = True
    ) -> list[str]:
        """Consecutive lines of one file (chosen by size), at least ``n_chars`` long when the file allows."""
        files = self.held if held else self.train
        if held:
            idx = int(rng.integers(len(files)))
        else:
            idx = int(rng.choice(len(files), p=self.weights))
        lines = files[idx][1]
        for _ in range(10):
            start = int(rng.integers(len(lines)))
            if not nonblank_start or lines[start].strip():
                break
        out, total = [], 0
        for ln in lines[start:]:
            out.append(ln)
            total += len(ln) + 1
            if total >= n_chars:
                break
        while out and not out[-1].strip():
            out.pop()
        return out or ["pass"]


# ============================================================================================ tokenizer


def train_tokenizer(corpus: Corpus, out_dir: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.train_texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))


def load_tokenizer(tok_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


# ============================================================================================ data mixture


class Mixture:
    """Builds training sequences of ``seq_len + 1`` tokens from "documents" joined by EOS.

    Documents: plain file text; "excerpt + separator + excerpt again" (sometimes lightly edited: a renamed
    identifier, a deleted / duplicated line, a changed number); file text with an earlier span repeated later.
    """

    def __init__(
        self,
        corpus: Corpus,
        tok,
        seq_len: int,
        chars_per_token: float,
        copy_share: float = 0.45,
        repeat_share: float = 0.2,
        synth_share: float = 0.0,
        synth_from_step: int = 0,
        edit_share: float = 0.25,
    ) -> None:
        self.corpus, self.tok, self.seq_len = corpus, tok, seq_len
        self.cpt = chars_per_token
        self.copy_share, self.repeat_share, self.edit_share = copy_share, repeat_share, edit_share
        self.synth_share, self.synth_from_step = synth_share, synth_from_step
        self.synth_active = False
        self.synth_now = synth_share
        self.synth_schedule: list[tuple[int, float]] = []
        self.eos_id = tok.convert_tokens_to_ids(EOS)

    def synthetic(self, rng: np.random.Generator) -> str:
        """Random identifiers, a separator, the same again: copying is the only way to predict the second half."""
        ids = self.corpus.identifiers
        n = int(rng.integers(6, 40))
        joins = [" ", ", ", "\n", ".", "(", " = ", "\n    "]
        parts = []
        for _i in range(n):
            parts.append(ids[int(rng.integers(len(ids)))])
            parts.append(joins[int(rng.integers(len(joins)))])
        text = "".join(parts).rstrip()
        sep = SEP if rng.random() < 0.6 else ALT_SEPS[int(rng.integers(len(ALT_SEPS)))]
        return text + sep + text

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _edit(self, rng: np.random.Generator, lines: list[str]) -> list[str]:
        lines = list(lines)
        for _ in range(int(rng.integers(1, 3))):
            kind = int(rng.integers(4))
            if kind == 0:  # rename one identifier everywhere
                words = sorted({w for ln in lines for w in re.findall(r"\b[a-z_][a-z0-9_]{2,}\b", ln)})
                if words and self.corpus.identifiers:
                    old = words[int(rng.integers(len(words)))]
                    new = self.corpus.identifiers[int(rng.integers(len(self.corpus.identifiers)))]
                    lines = [re.sub(rf"\b{re.escape(old)}\b", new, ln) for ln in lines]
            elif kind == 1 and len(lines) > 3:  # delete a line (not the first)
                del lines[int(rng.integers(1, len(lines)))]
            elif kind == 2 and len(lines) > 2:  # duplicate a line
                i = int(rng.integers(1, len(lines)))
                lines.insert(i, lines[i])
            else:  # change a number
                for i in rng.permutation(len(lines)):
                    if re.search(r"\d", lines[i]):
                        lines[i] = re.sub(r"\d+", lambda m: str(int(rng.integers(100))), lines[i], count=1)
                        break
        return lines

    def document(self, rng: np.random.Generator) -> str:
        if self.synth_active and rng.random() < self.synth_now:
            return self.synthetic(rng)
        r = rng.random()
        if r < self.copy_share:
            n_tok = int(rng.integers(12, int(self.seq_len * 0.48)))
            lines = self.corpus.window(rng, int(n_tok * self.cpt))
            sep = SEP if rng.random() < 0.6 else ALT_SEPS[int(rng.integers(len(ALT_SEPS)))]
            second = self._edit(rng, lines) if rng.random() < self.edit_share else lines
            return "\n".join(lines) + sep + "\n".join(second)
        if r < self.copy_share + self.repeat_share:
            lines = self.corpus.window(rng, int(self.seq_len * self.cpt))
            if len(lines) >= 6:
                span_len = int(rng.integers(2, max(3, len(lines) // 2)))
                s = int(rng.integers(0, len(lines) - span_len))
                ins = int(rng.integers(s + span_len, len(lines) + 1))
                lines = lines[:ins] + lines[s : s + span_len] + lines[ins:]
            return "\n".join(lines)
        n_tok = int(rng.integers(64, self.seq_len * 2))
        return "\n".join(self.corpus.window(rng, int(n_tok * self.cpt), nonblank_start=False))

    def sequence(self, rng: np.random.Generator) -> list[int]:
        ids: list[int] = []
        while len(ids) < self.seq_len + 1:
            ids += [*self.encode(self.document(rng)), self.eos_id]
        return ids[: self.seq_len + 1]

    def batch(self, seed: int, step: int, batch_size: int) -> torch.Tensor:
        rng = np.random.default_rng([seed, step])
        self.synth_active = self.synth_share > 0 and step >= self.synth_from_step
        self.synth_now = self.synth_share
        for from_step, share in self.synth_schedule:
            if step >= from_step:
                self.synth_active, self.synth_now = share > 0, share
        return torch.tensor([self.sequence(rng) for _ in range(batch_size)], dtype=torch.long)


# ============================================================================================ evaluation sets


def build_eval_prompts(
    corpus: Corpus, tok, seed: int, n_copy: int, n_free: int, cpt: float, max_total: int = 384
) -> list[dict]:
    """Held-out prompts. copy: excerpt + SEP + its first lines (prompt ends in a non-space character, so
    tokenize(prompt) + tokenize(continuation) == tokenize(prompt + continuation)); free: file lines to continue.
    Prompt + reference continuation fit in ``max_total`` tokens (the training sequence length)."""
    rng = np.random.default_rng([seed, 999_999])
    prompts: list[dict] = []

    def n_tokens(p: dict) -> int:
        return len(tok(p["prompt"] + p["reference_continuation"], add_special_tokens=False)["input_ids"])

    tries = 0
    while len([p for p in prompts if p["kind"] == "copy"]) < n_copy and tries < 10_000:
        tries += 1
        lines = corpus.window(rng, int(int(rng.integers(90, 160)) * cpt), held=True)
        if len(lines) < 6 or sum(1 for ln in lines if ln.strip()) < 5:
            continue
        k = 1
        while k < len(lines) - 3 and (len("\n".join(lines[:k])) < 40 or not lines[k - 1].strip()):
            k += 1
        if not lines[k - 1].strip():
            continue
        excerpt = "\n".join(lines)
        p = {
            "kind": "copy",
            "prompt": excerpt + SEP + "\n".join(lines[:k]),
            "reference_continuation": "\n" + "\n".join(lines[k:]),
        }
        if n_tokens(p) <= max_total:
            prompts.append(p)
    tries = 0
    while len([p for p in prompts if p["kind"] == "free"]) < n_free and tries < 10_000:
        tries += 1
        lines = corpus.window(rng, int(200 * cpt), held=True)
        k = len(lines) // 2
        while k > 2 and not lines[k - 1].strip():
            k -= 1
        if k < 3 or len(lines) - k < 3:
            continue
        p = {
            "kind": "free",
            "prompt": "\n".join(lines[:k]),
            "reference_continuation": "\n" + "\n".join(lines[k:]),
        }
        if n_tokens(p) <= max_total:
            prompts.append(p)
    return prompts


@torch.no_grad()
def greedy(model, ids: list[int], max_new: int, eos_id: int, device) -> list[int]:
    inp = torch.tensor([ids], device=device)
    out = model.generate(
        inp,
        attention_mask=torch.ones_like(inp),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    return out[0, len(ids) :].tolist()


def copy_probe(model, tok, prompts: list[dict], max_new: int, device) -> dict:
    """Free-running greedy on the copy prompts: share of reference tokens reproduced at the same position, the
    share of the exact-prefix match, and the 4-gram repetition rate inside the outputs."""
    model.eval()
    eos_id = tok.convert_tokens_to_ids(EOS)
    from lattice_inference.benchmark import copy_counts, repetition_rate

    match = total = prefix = 0
    reps = []
    for p in prompts:
        ref = tok(p["reference_continuation"], add_special_tokens=False)["input_ids"][:max_new]
        ids = tok(p["prompt"], add_special_tokens=False)["input_ids"]
        out = greedy(model, ids, len(ref), eos_id, device)
        matched, compared = copy_counts(out, ref, max_new)
        match += matched
        total += compared
        n = 0
        while n < min(len(ref), len(out)) and out[n] == ref[n]:
            n += 1
        prefix += n
        reps.append(repetition_rate(out))
    model.train()
    return {"copy": match / max(total, 1), "prefix": prefix / max(total, 1), "rep4": float(np.mean(reps))}


# ============================================================================================ trunk


def make_config(args, tok):
    vocab = len(tok)
    eos_id = tok.convert_tokens_to_ids(EOS)
    common = dict(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=0.02,
    )
    if args.arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    from transformers import Qwen3_5TextConfig

    pattern = args.layer_pattern.split(",")
    layer_types = [
        ("full_attention" if pattern[i % len(pattern)] == "F" else "linear_attention") for i in range(args.layers)
    ]
    return Qwen3_5TextConfig(
        **common,
        layer_types=layer_types,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=args.head_dim,
        linear_value_head_dim=args.head_dim,
        linear_num_key_heads=args.gdn_k_heads,
        linear_num_value_heads=args.gdn_v_heads,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False,
    )


def build_model(config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)


class LrSchedule:
    """Warmup, constant, then linear decay to 10 % over the last ``decay_frac`` of the run (by time or steps)."""

    def __init__(self, peak: float, warmup: int, decay_frac: float = 0.2) -> None:
        self.peak, self.warmup, self.decay_frac = peak, warmup, decay_frac

    def __call__(self, step: int, progress: float) -> float:
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        start = 1.0 - self.decay_frac
        if progress <= start:
            return self.peak
        return self.peak * max(0.1, 1.0 - 0.9 * (progress - start) / self.decay_frac)


def update(opt: torch.optim.Optimizer, loss: torch.Tensor, params, lr: float) -> None:
    """One optimiser step at learning rate ``lr``: backward, clip the gradient norm to 1, step, clear."""
    for g in opt.param_groups:
        g["lr"] = lr
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


@torch.no_grad()
def heldout_losses(model, batches: dict[str, torch.Tensor], device) -> dict[str, float]:
    model.eval()
    out = {}
    for name, x in batches.items():
        losses = []
        for i in range(0, x.shape[0], 4):
            xb = x[i : i + 4].to(device)
            losses.append(float(model(input_ids=xb, labels=xb, use_cache=False).loss))
        out[name] = float(np.mean(losses))
    model.train()
    return out


def heldout_batches(corpus: Corpus, mix: Mixture, seed: int, n: int) -> dict[str, torch.Tensor]:
    """Fixed held-out batches: plain held-out text and held-out copy documents."""
    rng = np.random.default_rng([seed, 424_242])
    plain, copy = [], []
    for _ in range(n):
        ids: list[int] = []
        while len(ids) < mix.seq_len + 1:
            ids += [*mix.encode("\n".join(corpus.window(rng, int(mix.seq_len * mix.cpt), held=True))), mix.eos_id]
        plain.append(ids[: mix.seq_len + 1])
        ids = []
        while len(ids) < mix.seq_len + 1:
            lines = corpus.window(rng, int(int(rng.integers(40, int(mix.seq_len * 0.45))) * mix.cpt), held=True)
            ids += [*mix.encode("\n".join(lines) + SEP + "\n".join(lines)), mix.eos_id]
        copy.append(ids[: mix.seq_len + 1])
    return {"plain": torch.tensor(plain), "copy": torch.tensor(copy)}


def save_ckpt(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train_trunk(args, corpus: Corpus, tok, mix: Mixture, probe_prompts: list[dict], device) -> dict:
    wd = Path(args.workdir)
    ckpt_path = wd / "trunk.pt"
    torch.manual_seed(args.seed)
    config = make_config(args, tok)
    model = build_model(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"trunk {config.model_type}: {n_params / 1e6:.2f}M parameters, layers {getattr(config, 'layer_types', None)}")
    decay, no_decay = [], []
    for _name, p in model.named_parameters():
        (no_decay if p.dim() < 2 else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    sched = LrSchedule(args.lr, args.warmup, args.decay_frac)
    state = {
        "step": 0,
        "elapsed": 0.0,
        "tokens": 0,
        "history": [],
        "deadline": args.trunk_minutes * 60.0,
        "done": False,
        "best_probe": None,
    }
    if args.resume and ckpt_path.exists():
        ck = torch.load(ckpt_path, map_location=device, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state = ck["state"]
        if args.extend_minutes:
            state["deadline"] += args.extend_minutes * 60.0
            state["done"] = False
        log(f"resumed at step {state['step']} ({state['tokens']} tokens, {state['elapsed'] / 60:.1f} min)")
    if state.get("done"):
        log("trunk already finished")
        return {"model": model, "config": config, "state": state, "n_params": n_params}
    held = heldout_batches(corpus, mix, args.seed, args.heldout_seqs)
    model.train()
    autocast = args.dtype == "bf16"
    t_start = time.time() - state["elapsed"]
    last_eval = last_ckpt = time.time()
    win_tokens, win_t0, loss_acc, loss_n = 0, time.time(), 0.0, 0
    max_steps = args.max_steps or 10**12

    def checkpoint() -> None:
        state["elapsed"] = time.time() - t_start
        save_ckpt(
            ckpt_path,
            {"model": model.state_dict(), "opt": opt.state_dict(), "state": state, "config": config.to_dict()},
        )

    def evaluate(final: bool = False) -> dict:
        t0 = time.time()
        hl = heldout_losses(model, held, device)
        pr = copy_probe(model, tok, probe_prompts, args.probe_tokens, device)
        rec = {
            "step": state["step"],
            "tokens": state["tokens"],
            "minutes": (time.time() - t_start) / 60,
            "heldout_plain": hl["plain"],
            "heldout_copy": hl["copy"],
            **{f"probe_{k}": v for k, v in pr.items()},
        }
        state["history"].append(rec)
        log(
            f"EVAL step {state['step']} tokens {state['tokens'] / 1e6:.2f}M | held-out loss plain {hl['plain']:.3f} "
            f"copy {hl['copy']:.3f} | copy probe {100 * pr['copy']:.1f}% (prefix {100 * pr['prefix']:.1f}%) "
            f"rep4 {100 * pr['rep4']:.1f}% | eval {time.time() - t0:.0f}s" + (" [final]" if final else "")
        )
        return rec

    while True:
        elapsed = time.time() - t_start
        progress = max(state["step"] / max_steps, elapsed / state["deadline"])
        if progress >= 1.0:
            break
        x = mix.batch(args.seed, state["step"], args.batch).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=x, labels=x, use_cache=False).loss
        lr = sched(state["step"], progress)
        update(opt, loss, model.parameters(), lr)
        state["step"] += 1
        state["tokens"] += x.numel()
        win_tokens += x.numel()
        loss_acc += loss.item()
        loss_n += 1
        now = time.time()
        if state["step"] % args.log_every == 0:
            tps = win_tokens / (now - win_t0)
            remaining = state["deadline"] - (now - t_start)
            log(
                f"step {state['step']} loss {loss_acc / loss_n:.3f} lr {lr:.2e} {tps:.0f} tok/s "
                f"tokens {state['tokens'] / 1e6:.2f}M elapsed {(now - t_start) / 60:.1f}m ETA {remaining / 60:.1f}m"
            )
            win_tokens, win_t0, loss_acc, loss_n = 0, now, 0.0, 0
        if now - last_eval >= args.eval_every_min * 60:
            rec = evaluate()
            last_eval = time.time()
            if rec["probe_copy"] >= args.target_copy and not state.get("target_hit"):
                state["target_hit"] = True
                # reached the target: finish with a short learning-rate decay, then stop
                elapsed_now = time.time() - t_start
                state["deadline"] = min(state["deadline"], elapsed_now + args.final_decay_min * 60)
                log(
                    f"copy probe reached {100 * rec['probe_copy']:.1f}% >= target; decaying until "
                    f"{state['deadline'] / 60:.1f} min"
                )
            win_t0 = time.time()
        if now - last_ckpt >= args.ckpt_every_min * 60:
            checkpoint()
            last_ckpt = time.time()
    final = evaluate(final=True)
    state["done"] = True
    state["final"] = final
    checkpoint()
    log(f"trunk done: {state['step']} steps, {state['tokens'] / 1e6:.2f}M tokens, {state['elapsed'] / 60:.1f} min")
    return {"model": model, "config": config, "state": state, "n_params": n_params}


# ============================================================================================ MTP head


def train_mtp(args, corpus, tok, mix, trunk: dict, device) -> dict:
    """MTP stage: the package trainer (``lattice_inference.train``, as ``lattice train-mtp``) on the frozen trunk,
    over windows of this tool's mixture; labels are the trunk's own next tokens (self-distilled)."""
    from lattice_inference.errors import ConfigError
    from lattice_inference.mtp.config import MtpConfig
    from lattice_inference.mtp.head_file import config_for_target
    from lattice_inference.train.data import ShardCache, trunk_rows
    from lattice_inference.train.loop import LoopConfig, train
    from lattice_inference.train.model import TrainableHead

    model = trunk["model"].eval()
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        cfg = MtpConfig.from_hf_config(trunk["config"], draft_length=2)
    except ConfigError:  # a trunk without a native MTP config (--arch qwen3): size the head from it
        cfg = config_for_target(trunk["config"], draft_length=2)
    torch.manual_seed(args.seed + 1)
    head = TrainableHead(cfg).to(device)
    head.init_from_target(model)
    mtp_seed = args.seed + 7919  # a different stream from the trunk's
    windows = [
        row for i in range(args.mtp_windows // args.batch) for row in mix.batch(mtp_seed, i, args.batch).tolist()
    ]
    held = heldout_batches(corpus, mix, args.seed, args.heldout_seqs)
    held_rows = trunk_rows(model, torch.cat([held["plain"], held["copy"]]).to(device))
    cache = ShardCache(Path(args.workdir) / "mtp_shards", windows, args.batch, model)
    loop = LoopConfig(
        steps=args.mtp_steps,
        batch=args.batch,
        lr=args.mtp_lr,
        probe_every_s=args.eval_every_min * 60,
        checkpoint_every_s=args.ckpt_every_min * 60,
        seed=args.seed,
    )
    embed = model.get_input_embeddings().weight
    state = train(
        head,
        cache,
        held_rows,
        embed,
        model.get_output_embeddings().weight,
        loop,
        checkpoint=Path(args.workdir) / "mtp.pt",
        resume=args.resume,
        on_checkpoint=lambda _state: None,
        log=log,
    )
    return {"head": head, "state": state}


# ============================================================================================ export


def export(args, tok, trunk: dict, mtp: dict, prompts: list[dict], corpus: Corpus, mix: Mixture, device) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(args.export_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, config, head = trunk["model"].cpu().float(), trunk["config"], mtp["head"].cpu().float()
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    sd.update(head.checkpoint_tensors())
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = [type(model).__name__]
    config.dtype = "bfloat16"
    config.save_pretrained(str(out))
    eos_id = tok.convert_tokens_to_ids(EOS)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False, max_new_tokens=128).save_pretrained(
        str(out)
    )
    tok.save_pretrained(str(out))
    with open(out / "eval_prompts.jsonl", "w") as fh:
        for p in prompts:
            fh.write(json.dumps(p) + "\n")
    log(f"exported to {out}: " + ", ".join(f"{f.name} {f.stat().st_size / 1e6:.2f}MB" for f in sorted(out.iterdir())))

    # ---- checks: transformers loads the trunk; the project's loader reproduces the MTP module
    from lattice_inference.mtp import load_mtp_head
    from lattice_inference.train.model import TrainableHead

    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    loaded.eval()
    ref = model.eval()
    with torch.no_grad():  # the same weights, rounded as stored (parameters only: buffers such as inv_freq stay fp32)
        for prm in ref.parameters():
            prm.copy_(prm.to(torch.bfloat16).float())
    x = mix.batch(args.seed + 31337, 0, 2)[:, :200]
    with torch.no_grad():
        a = loaded(input_ids=x).logits
        b = ref(input_ids=x).logits
    trunk_diff = float((a - b).abs().max())
    log(
        f"check: AutoModelForCausalLM.from_pretrained trunk logits max|diff| vs rounded training model = {trunk_diff:.2e}"
    )
    head_r = TrainableHead(head.cfg)
    head_r.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in head.state_dict().items()})
    head_r.eval()
    emb = loaded.model.embed_tokens.weight.detach().float()
    mtp_head = load_mtp_head(out, dtype=torch.float32, draft_length=2)
    with torch.no_grad():
        hid = loaded.model(input_ids=x[:1]).last_hidden_state.float()[0]
        lg_train = F.linear(head_r(hid[None, :-2], x[:1, 1:-1], emb), emb)
        mtp_head.reset_cache()
        lg_proj, _ = mtp_head.forward_many(x[0, 1:-1].tolist(), list(range(x.shape[1] - 2)), hid[:-2])
        # also one forward_one step on top (draft path)
        mtp_head.rollback_cache_to(50)
        l1, _ = mtp_head.forward_one(int(x[0, 51]), 50, hid[50])
    mtp_diff = float((lg_proj - lg_train[0]).abs().max())
    step_diff = float((l1 - lg_train[0, 50]).abs().max())
    agree = float((lg_proj.argmax(-1) == lg_train[0].argmax(-1)).float().mean())
    log(
        f"check: load_mtp_head logits max|diff| vs training module = {mtp_diff:.2e} (forward_one {step_diff:.2e}), "
        f"argmax agreement {100 * agree:.1f}%"
    )
    files = {f.name: f.stat().st_size for f in sorted(out.iterdir())}
    ts, ms = trunk["state"], mtp["state"]
    report = {
        "command": args.command_line,
        "seed": args.seed,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "corpus": {
            "stdlib": str(corpus.root),
            "train_files": len(corpus.train),
            "heldout_files": len(corpus.held),
            "heldout": [r for r, _ in corpus.held],
        },
        "architecture": {
            "model_type": config.model_type,
            "parameters_trunk": trunk["n_params"],
            "parameters_mtp": sum(p.numel() for p in head.parameters()),
            "layer_types": getattr(config, "layer_types", None),
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "seq_len": args.seq_len,
            "batch": args.batch,
            "train_dtype": args.dtype,
        },
        "trunk": {
            "steps": ts["step"],
            "tokens": ts["tokens"],
            "minutes": ts["elapsed"] / 60,
            "final": ts.get("final"),
            "history": ts["history"],
            "target_copy": args.target_copy,
        },
        "mtp": {
            "steps": ms.step,
            "tokens": ms.tokens,
            "minutes": ms.elapsed / 60,
            "init": ms.history[0] if ms.history else None,
            "final": ms.history[-1] if ms.history else None,
            "history": ms.history,
        },
        "export_checks": {
            "trunk_logits_max_abs_diff": trunk_diff,
            "mtp_logits_max_abs_diff": mtp_diff,
            "mtp_forward_one_max_abs_diff": step_diff,
            "mtp_argmax_agreement": agree,
        },
        "separator": SEP,
        "files": files,
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"report written; total size {sum(files.values()) / 1e6:.2f}MB")


# ============================================================================================ main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="train-run")
    ap.add_argument(
        "--export-dir", default=str(Path(__file__).resolve().parents[1] / "src/lattice_inference/default_model")
    )
    ap.add_argument("--stage", default="all", choices=["all", "tokenizer", "trunk", "mtp", "export"])
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arch", default="qwen3_5_text", choices=["qwen3_5_text", "qwen3"])
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--layer-pattern", default="L,F", help="repeating pattern, L = Gated DeltaNet, F = full attention")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--gdn-k-heads", type=int, default=2)
    ap.add_argument("--gdn-v-heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"], help="training compute (bf16 = autocast)")
    ap.add_argument(
        "--synth-share",
        type=float,
        default=0.5,
        help="share of synthetic 'random identifiers, separator, same again' documents (induction)",
    )
    ap.add_argument(
        "--copy-share", type=float, default=0.6, help="share of 'code chunk, separator, same chunk' documents"
    )
    ap.add_argument("--edit-share", type=float, default=0.15, help="share of copy documents whose copy is edited")
    ap.add_argument("--synth-from-step", type=int, default=0, help="synthetic documents only from this step on")
    ap.add_argument(
        "--synth-schedule",
        default="1600:0.3,3250:0.15",
        help="STEP:SHARE,... piecewise-constant synthetic share (overrides --synth-share from each STEP on)",
    )
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument(
        "--decay-frac", type=float, default=0.45, help="linear decay to 10%% of --lr over this last share of the run"
    )
    ap.add_argument("--max-steps", type=int, default=0, help="0: limited by --trunk-minutes only")
    ap.add_argument("--trunk-minutes", type=float, default=150.0)
    ap.add_argument("--extend-minutes", type=float, default=0.0, help="with --resume: add to the trunk budget")
    ap.add_argument("--target-copy", type=float, default=0.8)
    ap.add_argument("--final-decay-min", type=float, default=6.0)
    ap.add_argument("--mtp-steps", type=int, default=600, help="MTP stage: optimiser steps")
    ap.add_argument("--mtp-windows", type=int, default=1200, help="MTP stage: mixture windows of trunk states")
    ap.add_argument("--mtp-lr", type=float, default=1e-3)
    ap.add_argument("--eval-every-min", type=float, default=4.0)
    ap.add_argument("--ckpt-every-min", type=float, default=4.0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--heldout-seqs", type=int, default=16)
    ap.add_argument("--probe-prompts", type=int, default=24, help="held-out copy prompts in the probe")
    ap.add_argument("--probe-tokens", type=int, default=160, help="reference tokens compared per probe prompt")
    ap.add_argument("--eval-copy", type=int, default=24)
    ap.add_argument("--eval-free", type=int, default=12)
    args = ap.parse_args(argv)
    args.command_line = " ".join(
        shlex.quote(a) for a in ["tools/train_default_model.py", *(sys.argv[1:] if argv is None else argv)]
    )
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    wd = Path(args.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    log(f"command: {args.command_line}")
    import transformers

    transformers.logging.set_verbosity_error()
    corpus = Corpus(args.seed)
    log(f"corpus {corpus.root}: {len(corpus.train)} train files, {len(corpus.held)} held-out files")
    tok_dir = wd / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        t0 = time.time()
        train_tokenizer(corpus, tok_dir, args.vocab)
        log(f"tokenizer trained in {time.time() - t0:.0f}s")
    tok = load_tokenizer(tok_dir)
    sample = "\n".join("\n".join(lines) for _, lines in corpus.train[:40])
    cpt = len(sample) / len(tok(sample, add_special_tokens=False)["input_ids"])
    log(f"tokenizer: vocab {len(tok)}, {cpt:.2f} chars/token")
    if args.stage == "tokenizer":
        return
    mix = Mixture(
        corpus,
        tok,
        args.seq_len,
        cpt,
        copy_share=args.copy_share,
        edit_share=args.edit_share,
        synth_share=args.synth_share,
        synth_from_step=args.synth_from_step,
    )
    if args.synth_schedule:
        mix.synth_schedule = sorted(
            (int(a), float(b)) for a, b in (x.split(":") for x in args.synth_schedule.split(","))
        )
    prompts = build_eval_prompts(corpus, tok, args.seed, args.eval_copy, args.eval_free, cpt, args.seq_len)
    probe = [p for p in prompts if p["kind"] == "copy"][: args.probe_prompts]
    trunk = train_trunk(args, corpus, tok, mix, probe, device)
    if args.stage == "trunk":
        return
    mtp = train_mtp(args, corpus, tok, mix, trunk, device)
    if args.stage == "mtp":
        return
    # final quality numbers on the full eval set (copy and free) for the report
    model = trunk["model"]
    full = copy_probe(model, tok, [p for p in prompts if p["kind"] == "copy"], args.probe_tokens, device)
    free = copy_probe(model, tok, [p for p in prompts if p["kind"] == "free"], args.probe_tokens, device)
    log(f"eval set: copy {json.dumps(full)} free {json.dumps(free)}")
    trunk["state"]["eval_set"] = {"copy": full, "free": free}
    export(args, tok, trunk, mtp, prompts, corpus, mix, device)
    rep = json.loads((Path(args.export_dir) / "training_report.json").read_text())
    rep["eval_set"] = {"copy": full, "free": free, "max_new_tokens": args.probe_tokens}
    (Path(args.export_dir) / "training_report.json").write_text(json.dumps(rep, indent=1) + "\n")


if __name__ == "__main__":
    main()
