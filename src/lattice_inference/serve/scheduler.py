"""Continuous batching for the server: up to ``max_batch`` generations running at once on one worker thread.

The `Scheduler` takes requests from the server's `AdmissionQueue` (a bounded wait list, 429 past ``max_queue``,
arrival order) on its worker thread and keeps a running set (a `lattice_inference.batching.Driver`, the loop
`Generator.generate_many` drives too). Between steps it admits waiting requests in arrival order while fewer than
``max_batch`` run (each one's prefill runs at once, and its first tokens go out), drops those whose clients went
away, and then runs one step of each `lattice_inference.batching.Batch` (one per target: requests whose speculation
settings verify with another target run in its own batch), every running request advancing one round per step, so
none starves. Each round's tokens go to its request as a `Delta`; a request that ends (EOS, its length, a stop
string) gets its `Finish` and leaves, and the next waiting one takes its place. Errors are handed to the request
they belong to. ``max_batch`` 1 runs requests one at a time.

A request's tokens do not depend on what else runs: see `lattice_inference.batching`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lattice_inference.batching import Batch, Driver
from lattice_inference.generation import Generation
from lattice_inference.serve.engine import Reply
from lattice_inference.serve.queue import AdmissionQueue, Job


@dataclass(eq=False)
class _Running:
    """A request being generated: its job (the client's end), its reply and the batch it runs in."""

    job: Job
    reply: Reply
    batch: Batch


class Scheduler:
    """Runs submitted replies (each job's ``run`` returns a `Reply`) up to ``max_batch`` at once on its worker
    thread; see the module docstring."""

    def __init__(self, max_queue: int, max_batch: int, on_depth: Callable[[int, int], None] | None = None) -> None:
        self._driver = Driver(max_batch)
        """The running generations, a `Batch` per target: the loop `Generator.generate_many` drives too."""
        self.max_batch = self._driver.max_batch
        self.admission = AdmissionQueue(max_queue, self.max_batch, on_depth)
        self._running: list[_Running] = []
        self.taking_in = (0, 0)
        """Requests whose prompts are being taken in by chunks and the prompt rows they have left (`Driver.taking_in`,
        updated by the worker after each step)."""
        self._thread = threading.Thread(target=self._work, name="lattice-generation", daemon=True)
        self._thread.start()

    def submit(self, run: Callable[[], Any]) -> Job:
        """Queue a request (`AdmissionQueue.submit`; ``run`` returns its `Reply`, on the worker thread)."""
        return self.admission.submit(run)

    @property
    def waiting(self) -> int:
        """Requests submitted and not started yet."""
        return self.admission.waiting

    @property
    def running(self) -> int:
        """Requests being generated."""
        return self.admission.running

    def close(self) -> None:
        """Stop the worker once the requests running and queued have ended."""
        self.admission.close()

    @property
    def batched_rows(self) -> int:
        """Rows computed in forwards shared by two or more requests so far (`Batch.batched_rows`)."""
        return self._driver.batched_rows

    def _work(self) -> None:
        closing = False
        while not closing or self._running:
            closing = self._admit(closing)
            for run in [r for r in self._running if r.job.cancelled.is_set()]:
                run.batch.remove(run.reply.state)
                self._end(run, cancelled=True)
            for batch, outcome in self._driver.step():
                self._settle(batch, outcome)
            self.taking_in = self._driver.taking_in

    def _admit(self, closing: bool) -> bool:
        """Start waiting jobs while fewer than ``max_batch`` run (waiting for one when none runs); returns whether
        the queue was closed."""
        while not closing and len(self._running) < self.max_batch:
            try:
                job = self.admission.take(block=not self._running)
            except queue.Empty:
                break
            if job is None:
                return True
            self._start(job)
        return closing

    def _start(self, job: Job) -> None:
        self.admission.started(job)
        if job.cancelled.is_set():
            self._done(job, None)
            return
        try:
            reply: Reply = job.run()
            batch = self._driver.batch_for(reply.decoder.target)
            first = self._driver.admit(reply.decoder, reply.state, reply.owner)
        except Exception as exc:  # handed to the request that owns the job
            self._done(job, exc)
            return
        run = _Running(job, reply, batch)
        self._running.append(run)
        self._deliver(run, first)

    def _settle(self, batch: Batch, outcome: dict[Generation, list[int]] | Exception) -> None:
        """Hand one step's tokens to the requests of ``batch``, or its error to each of them (it ended them all)."""
        members = [r for r in self._running if r.batch is batch]
        if isinstance(outcome, Exception):
            for run in members:
                self._running.remove(run)
                run.reply.cancel()
                self._done(run.job, outcome)
            return
        for run in members:
            self._deliver(run, outcome.get(run.reply.state, []))

    def _deliver(self, run: _Running, chunk: list[int]) -> None:
        """Hand one round's tokens to the request; end it where it stopped. An error here (in its text or stop
        handling) ends this request with the error, and no other."""
        try:
            self._hand_over(run, chunk)
        except Exception as exc:  # handed to the request that owns the job
            if run in self._running:
                self._running.remove(run)
                run.batch.remove(run.reply.state)
                run.reply.cancel()
                self._done(run.job, exc)

    def _hand_over(self, run: _Running, chunk: list[int]) -> None:
        reply = run.reply
        if chunk:
            run.job._put(reply.delta(chunk))
        if reply.stopped and not reply.state.stop_reason:
            run.batch.remove(reply.state)  # a stop string: it runs no further
        if reply.stopped or reply.state.stop_reason:
            for item in reply.finish():
                run.job._put(item)
            self._end(run, cancelled=False)

    def _end(self, run: _Running, *, cancelled: bool) -> None:
        self._running.remove(run)
        if cancelled:
            run.reply.cancel()
        self._done(run.job, None)

    def _done(self, job: Job, error: BaseException | None) -> None:
        self.admission.finish(job, error)
