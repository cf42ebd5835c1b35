"""Stall detection behind the replicas' health checks, on a fake clock."""

from __future__ import annotations

import asyncio
import threading

import pytest

from serve_app.models.executor import BatchExecutor
from serve_app.models.health import LoopProgress, Stalled, StallWatch
from tests.unit.fakes import Clock


def test_work_past_the_limit_fails_the_check_and_passes_again_when_it_ends():
    clock = Clock()
    watch = StallWatch(clock)
    watch.check(10, "idle")  # nothing runs
    with watch.running():
        clock.now = 5
        with watch.running():  # a second unit, started later, does not hide the first
            clock.now = 10.5
            assert watch.longest_s() == 10.5
            with pytest.raises(Stalled, match="a batch has run for 10 s"):
                watch.check(10, "a batch")
    assert watch.longest_s() == 0.0
    watch.check(10, "a batch")


def test_an_executor_batch_that_never_returns_is_seen_by_the_watch():
    clock = Clock()
    release = threading.Event()

    def wedged(payloads: list[int]) -> list[int]:
        release.wait(10)
        return payloads

    async def scenario() -> None:
        ex = BatchExecutor(wedged, max_items=4, clock=clock)
        call = asyncio.ensure_future(ex.submit([1], 1))
        for _ in range(5000):  # until the worker thread has the batch
            if len(ex.watch):
                break
            await asyncio.sleep(0.001)
        assert len(ex.watch) == 1
        clock.now = 300
        with pytest.raises(Stalled):
            ex.watch.check(120, "a bulk batch")
        release.set()
        assert (await call)[0] == [1]
        ex.watch.check(120, "a bulk batch")

    asyncio.run(scenario())


def test_a_loop_that_owes_work_and_takes_no_step_fails_the_check():
    clock = Clock()
    progress = LoopProgress(clock)
    clock.now = 100
    progress.check(has_work=False, stepping=False, alive=False, limit_s=10, what="idle")  # owes nothing
    progress.arrived(had_work=False)  # work after a long idle: the wait starts now
    clock.now = 105
    progress.check(has_work=True, stepping=False, alive=True, limit_s=10, what="loop")
    with pytest.raises(Stalled, match="loop is not running"):
        progress.check(has_work=True, stepping=False, alive=False, limit_s=10, what="loop")
    clock.now = 111
    progress.arrived(had_work=True)  # more work does not reset a loop already owing some
    with pytest.raises(Stalled, match="waited 11 s without a step"):
        progress.check(has_work=True, stepping=False, alive=True, limit_s=10, what="loop")
    progress.check(has_work=True, stepping=True, alive=True, limit_s=10, what="loop")  # a step is running: StallWatch's
    progress.stepped()
    progress.check(has_work=True, stepping=False, alive=True, limit_s=10, what="loop")
