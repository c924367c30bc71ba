"""Training data for an MTP head: documents, self-distilled answers, token windows and the frozen trunk's states.

``--data`` names files and folders (plain text; ``.jsonl`` of ``{"text"}`` documents or of prompts,
``{"messages"}`` / ``{"prompt"}``) and two built-in sources: ``stdlib`` (the running Python's standard-library
sources, text that ships with Python) and ``prompts`` (`train.prompts.builtin_prompts`). With ``--self-distill``
prompts are answered by the target itself (greedy), so the head learns the model's own continuations.

Documents are packed into windows of ``seq_len + 1`` tokens. For each window the frozen target gives its
post-final-norm hiddens ``h`` and its own next-token choice; training row ``t`` is ``(h_t, x_{t+1})`` with label
``argmax lm_head(h_{t+1})``, the token the target would emit after ``x_{t+1}``: exactly what a greedy draft must
match to be accepted. Windows are computed in shards (`ShardCache`), kept on disk, so resuming costs nothing.
"""

from __future__ import annotations

import json
import random
import sysconfig
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lattice_inference.errors import ConfigError
from lattice_inference.train.prompts import builtin_prompts

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


@dataclass
class Sources:
    """Plain documents and chat prompts gathered from ``--data``."""

    texts: list[str]
    prompts: list[list[dict[str, str]]]


def _walk(root: Path) -> list[Path]:
    files = [p for p in sorted(root.rglob("*")) if p.suffix in TEXT_SUFFIXES and p.is_file()]
    return [p for p in files if not SKIP_DIRS & set(p.relative_to(root).parts)]


def _read_jsonl(path: Path, out: Sources) -> None:
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{path}:{i} is not JSON: {exc}") from exc
        if isinstance(rec, dict) and isinstance(rec.get("messages"), list):
            out.prompts.append([{"role": m["role"], "content": m["content"]} for m in rec["messages"]])
        elif isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            out.prompts.append([{"role": "user", "content": rec["prompt"]}])
        elif isinstance(rec, dict) and isinstance(rec.get("text"), str):
            out.texts.append(rec["text"])
        else:
            raise ConfigError(f"{path}:{i} needs a 'text', 'prompt' or 'messages' field")


def gather(data: Sequence[str], *, num_prompts: int = 320, seed: int = 0) -> Sources:
    """Read every ``--data`` entry (see the module docstring); raises `ConfigError` for a missing path."""
    out = Sources([], [])
    for entry in data:
        if entry == "stdlib":
            out.texts.extend(p.read_text(errors="replace") for p in _walk(Path(sysconfig.get_paths()["stdlib"])))
            continue
        if entry == "prompts":
            out.prompts.extend(builtin_prompts(num_prompts, seed))
            continue
        path = Path(entry)
        if not path.exists():
            raise ConfigError(f"--data {entry}: no such file or folder (or use 'stdlib' / 'prompts')")
        for file in _walk(path) if path.is_dir() else [path]:
            if file.suffix == ".jsonl":
                _read_jsonl(file, out)
            else:
                out.texts.append(file.read_text(errors="replace"))
    if not out.texts and not out.prompts:
        raise ConfigError("--data holds no text and no prompts")
    return out


def is_held_out(index: int, seed: int, fraction: float = 0.05) -> bool:
    """A fixed, seeded share of documents kept for the acceptance probe."""
    return zlib.crc32(f"{seed}:{index}".encode()) % 1000 < fraction * 1000


@torch.no_grad()
def self_distill(
    model: torch.nn.Module,
    tokenizer: object,
    prompts: Sequence[list[dict[str, str]]],
    *,
    max_new_tokens: int,
    cache: Path,
    batch_size: int = 16,
    log: Callable[[str], None] = print,
) -> list[list[int]]:
    """Each prompt's chat-template ids followed by the model's own greedy answer, cached (JSONL, one line per
    prompt, appended as batches finish) so an interrupted run resumes where it stopped."""
    done = _read_distilled(cache)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id  # type: ignore[attr-defined]
    for start in range(len(done), len(prompts), batch_size):
        batch = [
            tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)  # type: ignore[attr-defined]
            for m in prompts[start : start + batch_size]
        ]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(b)) + list(b) for b in batch])
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad
        )
        lines = []
        for b, row in zip(batch, out[:, width:].tolist(), strict=True):
            answer = list(row)
            while answer and answer[-1] == pad:
                answer.pop()
            lines.append(json.dumps(list(b) + answer + [pad]) + "\n")
        with cache.open("a") as f:
            f.write("".join(lines))
        done = _read_distilled(cache)
        log(f"self-distilled {len(done)}/{len(prompts)} prompts")
    return done


def _read_distilled(cache: Path) -> list[list[int]]:
    """The finished lines of a self-distillation cache (a line cut short by an interruption is dropped)."""
    done: list[list[int]] = []
    if cache.is_file():
        for line in cache.read_text().splitlines():
            try:
                done.append(json.loads(line))
            except ValueError:
                break
    return done


def pack(docs: Sequence[Sequence[int]], seq_len: int, sep: int, budget: int | None = None) -> list[list[int]]:
    """Concatenate documents (``sep`` between them) and cut into windows of ``seq_len + 1`` tokens, at most
    ``budget`` tokens in all."""
    stream: list[int] = []
    for doc in docs:
        stream.extend(doc)
        stream.append(sep)
        if budget is not None and len(stream) >= budget:
            break
    w = seq_len + 1
    return [stream[i : i + w] for i in range(0, len(stream) - w + 1, w)]


@torch.no_grad()
def trunk_rows(model: torch.nn.Module, windows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Training rows of ``windows [B, L]``: post-norm hiddens ``h_0..h_{L-2}`` (bfloat16), tokens
    ``x_1..x_{L-1}`` and labels ``argmax lm_head(h_1..h_{L-1})`` (the target's own next choice), on the CPU
    whatever device the model is on (shards are saved and sampled there)."""
    device = next(model.parameters()).device
    hidden = model.model(input_ids=windows.to(device), use_cache=False).last_hidden_state
    labels = model.get_output_embeddings()(hidden[:, 1:]).argmax(-1)
    return {
        "hidden": hidden[:, :-1].to(device="cpu", dtype=torch.bfloat16),
        "tokens": windows[:, 1:].to(torch.int32),
        "labels": labels.to(device="cpu", dtype=torch.int32),
    }


class ShardCache:
    """Windows computed through the frozen trunk in shards of ``shard_size`` windows, saved as
    ``DIR/shard-NNNNN.pt`` (atomically); `ensure(i)` computes shard ``i`` unless it is on disk."""

    def __init__(self, root: Path, windows: Sequence[Sequence[int]], shard_size: int, model: torch.nn.Module) -> None:
        self.root = root
        self.windows = list(windows)
        self.shard_size = shard_size
        self.model = model
        self.count = (len(self.windows) + shard_size - 1) // shard_size
        self._loaded: dict[int, dict[str, torch.Tensor]] = {}
        root.mkdir(parents=True, exist_ok=True)
        self._check_fingerprint()

    def _check_fingerprint(self) -> None:
        """Shards are only reusable for the same windows in the same order: a run resumed with other data (other
        ``--data``, ``--tokens``, ``--seq-len`` or prompts) is refused instead of silently mixing two data sets."""
        crc = zlib.crc32(json.dumps([self.shard_size, self.windows]).encode())
        stamp = {"windows": len(self.windows), "shard_size": self.shard_size, "crc32": crc}
        path = self.root / "windows.json"
        if path.is_file():
            old = json.loads(path.read_text())
            if old != stamp:
                raise ConfigError(
                    f"{self.root} holds trunk states of other training windows ({old['windows']} windows, crc "
                    f"{old['crc32']}; this run has {stamp['windows']}, crc {crc}): the data or its settings changed "
                    "since the run began; use a new --out (or delete that folder to recompute them)"
                )
        elif self.ready():
            return  # shards from before fingerprints were kept: nothing to compare against
        else:
            path.write_text(json.dumps(stamp) + "\n")

    def path(self, i: int) -> Path:
        return self.root / f"shard-{i:05d}.pt"

    def ready(self) -> list[int]:
        """Indices of the shards already on disk."""
        return [i for i in range(self.count) if self.path(i).is_file()]

    def ensure(self, i: int) -> dict[str, torch.Tensor]:
        """Shard ``i``, computed and saved first if needed."""
        if i in self._loaded:
            return self._loaded[i]
        if self.path(i).is_file():
            shard = torch.load(self.path(i), weights_only=True)
        else:
            rows = torch.tensor(self.windows[i * self.shard_size : (i + 1) * self.shard_size])
            shard = trunk_rows(self.model, rows)
            tmp = self.path(i).with_suffix(".tmp")
            torch.save(shard, tmp)
            tmp.replace(self.path(i))
        self._loaded[i] = shard
        return shard

    def sample(self, rng: random.Random, batch: int) -> dict[str, torch.Tensor]:
        """``batch`` random windows from the shards computed so far."""
        ready = self.ready()
        picks = [(rng.choice(ready), rng.randrange(self.shard_size)) for _ in range(batch)]
        rows = []
        for s, j in picks:
            shard = self.ensure(s)
            rows.append({k: v[j % v.shape[0]] for k, v in shard.items()})
        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
