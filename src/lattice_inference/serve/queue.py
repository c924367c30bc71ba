"""One worker thread per loaded model: jobs run one at a time, in arrival order, from a bounded queue.

A job is a function returning an iterator (a generation); the worker runs it off the event loop and hands each
item to the job's asyncio queue. Cancelling a job (its client went away) makes the worker close the iterator
after the item in flight, so a generation stops within one decode round and the next job starts.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
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


class GenerationQueue:
    """Runs submitted jobs one at a time on a daemon thread; at most ``max_queue`` may wait."""

    capacity = 1
    """Jobs that run at once (the rest wait)."""

    def __init__(self, max_queue: int, on_depth: Callable[[int, int], None] | None = None) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be non-negative, got {max_queue}")
        self.max_queue = max_queue
        self._on_depth = on_depth
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.pending = 0
        """Jobs submitted and not finished: the one running plus those waiting."""
        self.running = 0
        self._thread = threading.Thread(target=self._work, name="lattice-generation", daemon=True)
        self._thread.start()

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
        """Stop the worker after the job in flight."""
        self._jobs.put(None)

    def _report(self) -> None:
        if self._on_depth is not None:
            self._on_depth(self.waiting, self.running)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self.running = 1
                self._report()
            try:
                self._run(job)
            finally:
                with self._lock:
                    self.running = 0
                    self.pending -= 1
                    self._report()

    @staticmethod
    def _run(job: Job) -> None:
        job.started.set()
        error: BaseException | None = None
        items: Iterator[Any] | None = None
        try:
            if not job.cancelled.is_set():
                items = job.run()
                for item in items:
                    job._put(item)
                    if job.cancelled.is_set():
                        break
        except Exception as exc:  # handed to the request that owns the job
            error = exc
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as exc:
                    error = error or exc
            job._put(JobEnd(error))
