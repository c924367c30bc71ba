"""Several generations in one forward: continuous batching, each request with its own speculation.

A `Batch` runs the generations that share one target, each on its own target sequence (`Target.new_sequence`: its
cache, length and rows, owned by its `Generation`). A `step` plans every running generation's round
(`SpeculativeDecoder.plan`: its draft, weighed against the rows the other sequences already put in the step, so
drafts shrink as the batch grows, down to none), runs one forward over all their rows where the target batches
sequences (`Target.forward_batch`), else each generation's round in turn (`SpeculativeDecoder.round`), and
finishes each round (`SpeculativeDecoder.finish`: verification, rollback of its own sequence, emitted tokens).
Generations join (`add`, which prefills at once) and leave (`remove`, or when they stop) between steps; every
running generation advances every step, so none starves.

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
from lattice_inference.options import MAX_BATCH_ROWS, check_max_batch
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

    def open(self, gen: Generation, owner: str | None = "") -> list[int]: ...

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

    def __init__(self, target: Target, *, max_rows: int = MAX_BATCH_ROWS) -> None:
        if max_rows < 1:
            raise ConfigError(f"max_rows must be at least 1, got {max_rows}")
        self.target = target
        self.max_rows = max_rows
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
            first = decoder.open(gen, owner)
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
        try:
            if target.batches_sequences and len(members) > 1 and all(m.decoder.shares_forwards for m in members):
                chunks = self._batched(members)
            else:
                for member in members:
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
        """Plan every member's round, run them in one forward, finish each."""
        target, rounds = self.target, []
        planned = 0  # rows planned so far
        for i, member in enumerate(members):
            later = len(members) - i - 1  # one row each, at least
            rounds.append(
                member.decoder.plan(
                    member.gen,
                    rows_left=self.max_rows - planned - later,
                    shared_rows=planned + later,
                    shared_tokens=len(members) - 1,
                )
            )
            planned += len(rounds[-1].tokens)
        segments = []
        for member, planned_round in zip(members, rounds, strict=True):
            assert member.gen.sequence is not None
            segments.append(Segment(member.gen.sequence, planned_round.tokens, planned_round.parents))
        start = time.perf_counter()
        outputs = target.forward_batch(segments)
        seconds = time.perf_counter() - start
        self.batched_rows += planned
        chunks = {}
        for member, planned_round, output in zip(members, rounds, outputs, strict=True):
            chunk = member.decoder.finish(member.gen, planned_round, output.logits, output.hidden, planned, seconds)
            member.gen.token_ids.extend(chunk)
            chunks[member.gen] = chunk
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
