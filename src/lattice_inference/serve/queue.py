"""The server's admission: a bounded wait list of jobs in arrival order, and each job's items as they arrive.

A job is a request's function, run on the `lattice_inference.serve.scheduler.Scheduler`'s worker thread, off the
event loop; the worker hands each of its items to the job's asyncio queue, where the request reads them
(`Job.results`). Cancelling a job (its client went away) makes the worker drop it before its next round.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any


class QueueFull(Exception):
    """The queue already holds ``max_queue`` waiting jobs."""


class JobEnd:
    """Marks the end of a job's items; carries the exception the job raised, if any."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class Job:
    """One submitted generation: its items arrive on ``items`` (an asyncio queue) in the submitting loop."""

    def __init__(self, run: Callable[[], Any], loop: asyncio.AbstractEventLoop) -> None:
        self.run = run
        self.loop = loop
        self.items: asyncio.Queue[Any] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.started = threading.Event()

    def cancel(self) -> None:
        """Ask the worker to stop this job (before it starts, or after the item in flight)."""
        self.cancelled.set()

    def _put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled.set()

    async def results(self) -> AsyncIterator[Any]:
        """The job's items as the worker produces them (none once cancelled); re-raises the job's exception."""
        while True:
            item = await self.items.get()
            if isinstance(item, JobEnd):
                if item.error is not None and not self.cancelled.is_set():
                    raise item.error
                return
            if not self.cancelled.is_set():
                yield item


class AdmissionQueue:
    """The server's wait list: jobs in arrival order, at most ``max_queue`` waiting beside the ``capacity`` running
    (`QueueFull` past that: a 429), with the depth reported on every change. It only admits: the `Scheduler`'s
    worker takes jobs from it (`take`), says when one starts (`started`) and hands each its end (`finish`)."""

    def __init__(self, max_queue: int, capacity: int, on_depth: Callable[[int, int], None] | None = None) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be non-negative, got {max_queue}")
        self.max_queue = max_queue
        self.capacity = capacity
        """Jobs that run at once (the rest wait)."""
        self._on_depth = on_depth
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.pending = 0
        """Jobs submitted and not finished: those running plus those waiting."""
        self.running = 0

    def submit(self, run: Callable[[], Any]) -> Job:
        """Queue ``run`` (called on the worker thread); raise `QueueFull` when ``max_queue`` jobs wait already."""
        job = Job(run, asyncio.get_running_loop())
        with self._lock:
            if self.pending >= self.max_queue + self.capacity:
                raise QueueFull(f"{self.waiting} requests are waiting already, the most this server queues")
            self.pending += 1
            self._report()
        self._jobs.put(job)
        return job

    @property
    def waiting(self) -> int:
        """Jobs submitted and not started yet."""
        return self.pending - self.running

    def close(self) -> None:
        """No more jobs: `take` returns None once the jobs queued before are taken."""
        self._jobs.put(None)

    def take(self, block: bool) -> Job | None:
        """The next waiting job in arrival order (None: the queue was closed); waits for one where ``block``, else
        raises ``queue.Empty`` when none waits."""
        return self._jobs.get(block=block)

    def started(self, job: Job) -> None:
        """``job`` was taken and runs now."""
        job.started.set()
        with self._lock:
            self.running += 1
            self._report()

    def finish(self, job: Job, error: BaseException | None) -> None:
        """``job`` ended (with ``error``, handed to its request, or None): it leaves the count, then its end goes out
        (in that order, so a client that saw its answer end never reads it as still running)."""
        with self._lock:
            self.running -= 1
            self.pending -= 1
            self._report()
        job._put(JobEnd(error))

    def _report(self) -> None:
        if self._on_depth is not None:
            self._on_depth(self.waiting, self.running)
