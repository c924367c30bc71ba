"""Several generations in one forward: continuous batching, each request with its own speculation.

A `Batch` runs the generations that share one target, each on its own target sequence (`Target.new_sequence`: its
cache, length and rows, owned by its `Generation`). A `step` plans every running generation's round
(`SpeculativeDecoder.plan`: its draft, weighed against the rows the other sequences already put in the step, so
drafts shrink as the batch grows, down to none), runs one forward over all their rows where the target batches
sequences (`Target.forward_batch`), else each generation's round in turn (`SpeculativeDecoder.round`), and
finishes each round (`SpeculativeDecoder.finish`: verification, rollback of its own sequence, emitted tokens).
Generations join (`add`) and leave (`remove`, or when they stop) between steps; every running generation advances
every step, so none starves. A generation joins with its prefill, except a long prompt where the target takes a
prompt in by forwards (`Target.open_prompt`): then its rows left after any reused prefix are fed a chunk per step
(`prompt_chunk` rows, from the target's measured costs) in the same forward as the other generations' rounds, so
their streams keep moving while it arrives; its last chunk's last row chooses its first token, as a prefill's does.

Why each request's output does not depend on the batch: in a batched forward every row is computed by the same
instructions as in its sequence's own forward (row-exact products over all rows, rotary embedding, cache writes and
attention per sequence: `decode_layers`), and the load-time self-check compares batched rows with rows alone; every
choice depends only on its row's logits, the request's seed and the token's index (`lattice_inference.sampling`).
So greedy or seeded, each generation emits token for token what it emits alone, whatever shares its steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lattice_inference.drafters.base import Drafter
from lattice_inference.errors import ConfigError
from lattice_inference.generation import Generation
from lattice_inference.options import (
    MAX_BATCH_ROWS,
    PROMPT_CHUNK,
    PROMPT_CHUNK_MAX,
    PROMPT_CHUNK_MIN,
    PROMPT_CHUNK_STEPS,
    check_max_batch,
)
from lattice_inference.targets.base import Segment, Target
from lattice_inference.targets.facts import ForwardCosts
from lattice_inference.targets.forward_cost import forward_costs

__all__ = ["Batch", "Decoder", "Driver"]


class Decoder(Protocol):
    """What a `Batch` drives: a `lattice_inference.decode.SpeculativeDecoder`, named by the parts a batch calls, so
    that the decoder runs a generation alone as a batch of one (`SpeculativeDecoder.start`) without a circle of
    imports. A round is `plan` (a `Round`: its ``tokens`` and ``parents``), the target's forward, then `finish`."""

    target: Target
    adaptive: bool
    drafter: Drafter | None
    costs: ForwardCosts | None

    @property
    def shares_forwards(self) -> bool:
        """Whether its rounds may share a batched forward (its target's self-check found nothing that differs)."""
        ...

    def widest(self) -> int: ...

    def open(self, gen: Generation, owner: str | None = "", *, chunk: int = 0) -> list[int]: ...

    def take_in(self, gen: Generation, chunk: int) -> Segment: ...

    def taken_in(self, gen: Generation, logits: torch.Tensor) -> list[int]: ...

    def plan(
        self, gen: Generation, *, rows_left: int | None = None, shared_rows: int = 0, shared_tokens: int = 0
    ) -> Any: ...

    def round(self, gen: Generation) -> list[int]: ...

    def finish(
        self,
        gen: Generation,
        planned: Any,
        logits: torch.Tensor,
        hidden: torch.Tensor | None,
        width: int,
        seconds: float,
    ) -> list[int]: ...

    def close(self, gen: Generation) -> None: ...


@dataclass(eq=False)
class _Member:
    """A running generation and the decoder whose settings (drafter, planner) run it."""

    decoder: Decoder
    gen: Generation


class Batch:
    """The running generations on ``target`` (see the module docstring); at most ``max_rows`` rows per step (every
    generation gets its pending token's row; drafts share what is left)."""

    def __init__(self, target: Target, *, max_rows: int = MAX_BATCH_ROWS, prompt_chunks: bool = True) -> None:
        if max_rows < 1:
            raise ConfigError(f"max_rows must be at least 1, got {max_rows}")
        self.target = target
        self.max_rows = max_rows
        self.prompt_chunks = prompt_chunks
        """Whether long prompts are taken in by chunks beside the running generations (see the module docstring;
        a generation run alone prefills whole)."""
        self._members: list[_Member] = []
        self.steps = 0
        """Steps run so far."""
        self.batched_rows = 0
        """Rows computed in forwards shared by two or more sequences (0 where the target runs them one by one)."""

    def __len__(self) -> int:
        return len(self._members)

    @property
    def generations(self) -> list[Generation]:
        """The running generations, in the order they joined."""
        return [m.gen for m in self._members]

    def add(self, decoder: Decoder, gen: Generation, owner: str | None = "") -> list[int]:
        """Start ``gen`` (made by ``decoder.new_generation``) on a new sequence of the target, whose prefill may
        reuse ``owner``'s earlier rows; returns its first tokens. A generation that stops at once (EOS, a budget
        of one token) is ended before this returns; the others run in the following steps."""
        if decoder.target is not self.target:
            raise ConfigError("a batch runs generations of one target; this decoder verifies with another")
        if len(self._members) >= self.max_rows:
            raise ConfigError(f"a batch of at most {self.max_rows} rows per step is full")
        if gen.max_new_tokens == 0:
            gen.stop_reason = "length"
            return []
        member = _Member(decoder, gen)
        try:
            self.prepare(decoder)
            first = decoder.open(gen, owner, chunk=self.prompt_chunk if self.prompt_chunks else 0)
        except BaseException:
            self._end(member)
            raise
        gen.token_ids.extend(first)
        if gen.stop_reason:
            self._end(member)
        else:
            self._members.append(member)
        return first

    def prepare(self, decoder: Decoder) -> float:
        """Measure the target's forward costs up to a full step's rows (``max_rows``), once per target, where
        ``decoder`` plans its drafts by them: the planner weighs a round's rows against the step's (measured on a
        scratch sequence). Returns the seconds spent (next to nothing when done)."""
        start = time.perf_counter()
        wider = self.max_rows > decoder.widest()  # else the decoder's own measurement covers the rows (alone)
        if wider and decoder.adaptive and decoder.drafter is not None and decoder.costs is None:
            forward_costs(self.target, self.max_rows)
        return time.perf_counter() - start

    @property
    def prompt_chunk(self) -> int:
        """Rows of a prompt taken in per step beside running generations: the most (doubling from
        `PROMPT_CHUNK_MIN`, at most `PROMPT_CHUNK_MAX`) whose forward costs at most `PROMPT_CHUNK_STEPS` one-token
        forwards by the target's measured costs (`PROMPT_CHUNK` where none were measured)."""
        costs = self.target.facts.costs
        if costs is None:
            return PROMPT_CHUNK
        rows = PROMPT_CHUNK_MIN
        while rows < PROMPT_CHUNK_MAX and costs.relative(2 * rows) <= PROMPT_CHUNK_STEPS:
            rows *= 2
        return rows

    def remove(self, gen: Generation) -> None:
        """End ``gen`` now (its client went away): its decode time is filled in and its sequence released."""
        for member in self._members:
            if member.gen is gen:
                self._members.remove(member)
                self._end(member)
                return

    def close(self) -> None:
        """End every running generation."""
        while self._members:
            self._end(self._members.pop())

    def step(self) -> dict[Generation, list[int]]:
        """One round of every running generation; returns the tokens each emitted (possibly none). Those that
        stopped are ended and leave the batch."""
        members = list(self._members)
        if not members:
            return {}
        target = self.target
        chunks: dict[Generation, list[int]] = {}
        intake = any(m.gen.prompt_left for m in members)
        try:
            shared = target.batches_sequences and all(m.decoder.shares_forwards for m in members)
            if shared and (len(members) > 1 or intake):
                chunks = self._batched(members)
            else:
                for member in members:
                    if member.gen.prompt_left:  # a prompt's chunk alone
                        chunks.update(self._batched([member]))
                        continue
                    chunks[member.gen] = member.decoder.round(member.gen)
                    member.gen.token_ids.extend(chunks[member.gen])
        except BaseException:
            self.close()
            raise
        self.steps += 1
        for member in members:
            if member.gen.stop_reason:
                self._members.remove(member)
                self._end(member)
        return chunks

    def _batched(self, members: list[_Member]) -> dict[Generation, list[int]]:
        """Plan every member's round (or take the next chunk of its prompt), run them in one forward, finish
        each."""
        target = self.target
        taking = [m for m in members if m.gen.prompt_left]
        decoding = [m for m in members if not m.gen.prompt_left]
        rows = self.prompt_chunk if decoding else PROMPT_CHUNK_MAX
        prompt = {m.gen: m.decoder.take_in(m.gen, rows) for m in taking}
        prompt_rows = sum(len(segment.tokens) for segment in prompt.values())
        rounds: dict[Generation, Any] = {}
        planned = 0  # decoding rows planned so far
        for i, member in enumerate(decoding):
            later = len(decoding) - i - 1  # one row each, at least
            rounds[member.gen] = member.decoder.plan(
                member.gen,
                rows_left=self.max_rows - planned - later,
                shared_rows=planned + later + prompt_rows,
                shared_tokens=len(decoding) - 1,
            )
            planned += len(rounds[member.gen].tokens)
        segments = []
        for member in members:
            gen = member.gen
            assert gen.sequence is not None
            if gen in prompt:
                segments.append(prompt[gen])
            else:
                segments.append(Segment(gen.sequence, rounds[gen].tokens, rounds[gen].parents))
        start = time.perf_counter()
        outputs = target.forward_batch(segments)
        seconds = time.perf_counter() - start
        width = planned + prompt_rows
        if len(segments) > 1:
            self.batched_rows += width
        chunks = {}
        for member, output in zip(members, outputs, strict=True):
            gen, decoder = member.gen, member.decoder
            if gen in prompt:
                chunk = decoder.taken_in(gen, output.logits) if not gen.prompt_left else []
            else:
                chunk = decoder.finish(gen, rounds[gen], output.logits, output.hidden, width, seconds)
            gen.token_ids.extend(chunk)
            chunks[gen] = chunk
        return chunks

    @staticmethod
    def _end(member: _Member) -> None:
        member.decoder.close(member.gen)  # releases its sequence


class Driver:
    """The one admit-then-step loop's running set: up to ``max_batch`` generations, in one `Batch` per target
    (generations whose decoders verify with different targets run in different batches). `Generator.generate_many`
    and the server's `Scheduler` both drive it the same way: `admit` while `has_room`, then `step`; a generation
    that stops leaves its batch in the step that ends it, and the next one takes its place."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = check_max_batch(max_batch)
        self._batches: dict[int, Batch] = {}

    def __len__(self) -> int:
        return sum(len(batch) for batch in self._batches.values())

    @property
    def has_room(self) -> bool:
        """Whether fewer than ``max_batch`` generations run."""
        return len(self) < self.max_batch

    @property
    def batched_rows(self) -> int:
        """Rows computed in forwards shared by two or more generations so far (`Batch.batched_rows`)."""
        return sum(batch.batched_rows for batch in self._batches.values())

    @property
    def taking_in(self) -> tuple[int, int]:
        """Generations whose prompts are being taken in by chunks, and the prompt rows they have left."""
        joining = [gen for batch in self._batches.values() for gen in batch.generations if gen.prompt_left]
        return len(joining), sum(len(gen.prompt_left) for gen in joining)

    def batch_for(self, target: Target) -> Batch:
        """The batch of ``target``'s generations (made on first use)."""
        batch = self._batches.get(id(target))
        if batch is None or batch.target is not target:
            if 0 < target.kv_slots < self.max_batch:  # every running generation holds a cache slot
                raise ConfigError(f"kv_slots ({target.kv_slots}) must be at least max_batch ({self.max_batch})")
            batch = self._batches[id(target)] = Batch(target)
        return batch

    def admit(self, decoder: Decoder, gen: Generation, owner: str | None = "") -> list[int]:
        """Start ``gen`` in its target's batch (`Batch.add`); returns its first tokens."""
        return self.batch_for(decoder.target).add(decoder, gen, owner)

    def step(self) -> list[tuple[Batch, dict[Generation, list[int]] | Exception]]:
        """One step of every batch that runs a generation: per batch, the tokens each of its generations emitted
        (`Batch.step`), or the error that ended all of them (the other batches still step)."""
        outcomes: list[tuple[Batch, dict[Generation, list[int]] | Exception]] = []
        for batch in list(self._batches.values()):
            if len(batch):
                try:
                    outcomes.append((batch, batch.step()))
                except Exception as exc:  # `Batch.step` ended every generation in it
                    outcomes.append((batch, exc))
        return outcomes

    def close(self) -> None:
        """End every running generation."""
        for batch in self._batches.values():
            batch.close()
