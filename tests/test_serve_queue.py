"""The bounded worker: arrival order, one job at a time, a bounded wait list, cancellation, errors."""

from __future__ import annotations

import asyncio
import threading

import pytest

from lattice_inference.serve.queue import GenerationQueue, QueueFull


def test_jobs_run_in_order_one_at_a_time_and_the_wait_list_is_bounded():
    gate = threading.Event()
    log: list[str] = []

    def job(name: str, wait: bool = False):
        def run():
            log.append(f"start {name}")
            if wait:
                gate.wait(10)
            yield name
            log.append(f"end {name}")

        return run

    async def main():
        queue = GenerationQueue(max_queue=2)
        first = queue.submit(job("a", wait=True))
        while not first.started.is_set():
            await asyncio.sleep(0.001)
        rest = [queue.submit(job("b")), queue.submit(job("c"))]
        with pytest.raises(QueueFull):
            queue.submit(job("d"))
        assert (queue.waiting, queue.running) == (2, 1)
        gate.set()
        outs = [[item async for item in j.results()] for j in (first, *rest)]
        queue.close()
        return outs

    assert asyncio.run(main()) == [["a"], ["b"], ["c"]]
    assert log == ["start a", "end a", "start b", "end b", "start c", "end c"]


def test_cancel_closes_the_iterator_after_the_item_in_flight_and_errors_reach_the_caller():
    closed = threading.Event()

    def endless():
        try:
            n = 0
            while True:
                n += 1
                yield n
        finally:
            closed.set()

    def broken():
        yield 1
        raise RuntimeError("boom")

    async def main():
        queue = GenerationQueue(max_queue=4)
        job = queue.submit(endless)
        got = []
        async for item in job.results():
            got.append(item)
            if item == 3:
                job.cancel()
        failing = queue.submit(broken)
        with pytest.raises(RuntimeError, match="boom"):
            async for _ in failing.results():
                pass
        queue.close()
        return got

    got = asyncio.run(main())
    assert closed.is_set() and got == [1, 2, 3]
