"""The server's admission: arrival order, a bounded wait list, the depth it reports, each job's items and its end."""

from __future__ import annotations

import asyncio
import queue

import pytest

from lattice_inference.serve.queue import AdmissionQueue, QueueFull


def test_jobs_are_taken_in_arrival_order_and_the_wait_list_is_bounded():
    depths: list[tuple[int, int]] = []

    async def main() -> None:
        admission = AdmissionQueue(max_queue=2, capacity=1, on_depth=lambda w, r: depths.append((w, r)))
        jobs = [admission.submit(lambda name=name: name) for name in "abc"]  # one may run, two wait
        with pytest.raises(QueueFull, match="3 requests are waiting"):
            admission.submit(lambda: "d")
        first = admission.take(block=False)
        assert first is jobs[0]
        admission.started(first)
        assert (admission.waiting, admission.running) == (2, 1)
        with pytest.raises(QueueFull):  # still full: one runs, two wait
            admission.submit(lambda: "d")
        admission.finish(first, None)
        assert (admission.waiting, admission.running) == (2, 0)
        late = admission.submit(lambda: "d")  # room again
        assert [admission.take(block=False) for _ in range(3)] == [jobs[1], jobs[2], late]
        with pytest.raises(queue.Empty):
            admission.take(block=False)
        admission.close()
        assert admission.take(block=True) is None
        assert [item async for item in first.results()] == []  # ended with no items and no error

    asyncio.run(main())
    assert depths[:3] == [(1, 0), (2, 0), (3, 0)] and depths[3:5] == [(2, 1), (2, 0)]


def test_a_jobs_items_reach_its_request_and_its_error_is_raised_there_unless_cancelled():
    async def main() -> None:
        admission = AdmissionQueue(max_queue=4, capacity=1)
        ok, failing, cancelled = (admission.submit(lambda: None) for _ in range(3))
        for job, error in ((ok, None), (failing, RuntimeError("boom")), (cancelled, RuntimeError("late"))):
            assert admission.take(block=False) is job
            admission.started(job)
            for item in (1, 2):
                job._put(item)
            if job is cancelled:
                job.cancel()
            admission.finish(job, error)
        assert [item async for item in ok.results()] == [1, 2]
        with pytest.raises(RuntimeError, match="boom"):
            async for _ in failing.results():
                pass
        assert [item async for item in cancelled.results()] == []  # its client went away: nothing, no error
        assert admission.pending == 0

    asyncio.run(main())
