"""The replica's batch executor. Runs are gated by events and time is a fake clock,
so what ran together and how long each call waited are exact, whatever the machine's load."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from serve_app.models.executor import BatchExecutor
from tests.unit.fakes import Clock

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class GatedRun:
    """A run function that records its batches and, while `gated`, holds each batch until released."""

    def __init__(self, clock: Clock, gated: bool = False) -> None:
        self.clock = clock
        self.batches: list[list[int]] = []
        self.running = 0
        self.max_running = 0
        self.lock = threading.Lock()
        self.started = threading.Event()
        self.release = threading.Event()
        if not gated:
            self.release.set()

    def __call__(self, payloads: list[int]) -> list[object]:
        with self.lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        self.batches.append(list(payloads))
        self.started.set()
        assert self.release.wait(10), "the test never released the batch"
        with self.lock:
            self.running -= 1
        return [ValueError("negative") if p < 0 else p * 10 for p in payloads]


async def started(run: GatedRun) -> None:
    """Wait (off the event loop) until `run` holds a batch."""
    assert await asyncio.get_running_loop().run_in_executor(None, run.started.wait, 10)


async def test_calls_queued_behind_a_running_batch_are_merged_one_batch_at_a_time():
    clock = Clock()
    run = GatedRun(clock, gated=True)
    ex = BatchExecutor(run, max_items=4, clock=clock)
    first = asyncio.ensure_future(ex.submit([1], 1))
    await started(run)
    rest = [asyncio.ensure_future(ex.submit([i], 1)) for i in range(2, 7)]
    await asyncio.sleep(0)  # the five calls are queued behind the running batch
    clock.now = 0.02
    run.release.set()
    results = await asyncio.gather(first, *rest)
    assert [r[0] for r in results] == [[10], [20], [30], [40], [50], [60]]
    assert run.batches == [[1], [2, 3, 4, 5], [6]]
    assert run.max_running == 1
    waits = [r[1] for r in results]
    assert waits[0] == 0.0 and waits[1:] == [pytest.approx(0.02)] * 5  # queued calls report their wait


async def test_an_error_result_stays_with_its_payload():
    ex = BatchExecutor(GatedRun(Clock()), max_items=8)
    (results, _, _), (other, _, _) = await asyncio.gather(ex.submit([1, -1], 2), ex.submit([2], 1))
    assert results[0] == 10 and isinstance(results[1], ValueError) and other == [20]


async def test_a_crashing_batch_fails_its_calls_and_the_executor_goes_on():
    calls = 0

    def flaky(payloads: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom")
        return payloads

    ex = BatchExecutor(flaky, max_items=8)
    with pytest.raises(RuntimeError):
        await ex.submit([1], 1)
    assert (await ex.submit([2], 1))[0] == [2]


async def test_oversized_call_runs_alone():
    run = GatedRun(Clock(), gated=True)
    ex = BatchExecutor(run, max_items=2)
    big = asyncio.ensure_future(ex.submit([1, 2, 3], 3))
    await started(run)
    small = asyncio.ensure_future(ex.submit([4], 1))
    await asyncio.sleep(0)
    run.release.set()
    await asyncio.gather(big, small)
    assert run.batches == [[1, 2, 3], [4]]


async def test_several_runs_take_batches_side_by_side_and_each_runs_one_at_a_time():
    """One worker per run function (one per session): two batches run at once, never two on
    one session, and calls queued behind both still merge."""
    clock = Clock()
    runs = [GatedRun(clock, gated=True), GatedRun(clock, gated=True)]
    pool = ThreadPoolExecutor(2)
    ex = BatchExecutor(list(runs), max_items=4, pool=pool, clock=clock)
    first = [asyncio.ensure_future(ex.submit([1], 1))]
    await started(runs[0])
    first.append(asyncio.ensure_future(ex.submit([2], 1)))  # finds the other worker free
    await started(runs[1])  # both hold a batch at once: side by side
    rest = [asyncio.ensure_future(ex.submit([i], 1)) for i in range(3, 9)]
    await asyncio.sleep(0)
    clock.now = 0.05
    for run in runs:
        run.release.set()
    results = await asyncio.gather(*first, *rest)
    pool.shutdown()
    assert [r[0] for r in results] == [[i * 10] for i in range(1, 9)]
    assert [runs[0].batches[0], runs[1].batches[0]] == [[1], [2]]  # side by side, one call each
    assert all(r.max_running == 1 for r in runs)
    ran = sorted(p for r in runs for b in r.batches for p in b)
    assert ran == list(range(1, 9))
    assert sum(len(r.batches) for r in runs) <= 4  # 3..8 merged into batches of up to 4
    # [2] started at once beside [1]; the calls queued behind both waited for them.
    assert results[1][1] == 0.0 and min(r[1] for r in results[2:]) == pytest.approx(0.05)


async def test_an_urgent_call_runs_next_ahead_of_the_bulk_calls_waiting_and_alone():
    """A high-priority batch on a replica without an urgent session: it waits for the running
    batch only, not for the bulk calls queued before it, and no bulk row lengthens its batch."""
    clock = Clock()
    run = GatedRun(clock, gated=True)
    ex = BatchExecutor(run, max_items=4, clock=clock)
    running = asyncio.ensure_future(ex.submit([1], 1))
    await started(run)
    bulk = [asyncio.ensure_future(ex.submit([i], 1)) for i in (2, 3)]
    await asyncio.sleep(0)
    urgent = [asyncio.ensure_future(ex.submit([i], 1, urgent=True)) for i in (8, 9)]
    more_bulk = asyncio.ensure_future(ex.submit([4], 1))
    await asyncio.sleep(0)
    clock.now = 0.03
    run.release.set()
    results = await asyncio.gather(running, *bulk, *urgent, more_bulk)
    assert [r[0] for r in results] == [[10], [20], [30], [80], [90], [40]]
    # The urgent calls merge with each other, in their order, and run before every bulk call queued.
    assert run.batches == [[1], [8, 9], [2, 3, 4]]


async def test_urgent_calls_over_max_items_keep_their_order_and_bulk_waits_for_all_of_them():
    run = GatedRun(Clock(), gated=True)
    ex = BatchExecutor(run, max_items=2)
    running = asyncio.ensure_future(ex.submit([1], 1))
    await started(run)
    calls = [
        asyncio.ensure_future(ex.submit([2], 1)),
        asyncio.ensure_future(ex.submit([7, 8], 2, urgent=True)),
        asyncio.ensure_future(ex.submit([9], 1, urgent=True)),
    ]
    await asyncio.sleep(0)
    run.release.set()
    await asyncio.gather(running, *calls)
    assert run.batches == [[1], [7, 8], [9], [2]]


async def test_a_bulk_call_waits_behind_urgent_calls_no_longer_than_its_bound():
    """More high priority than the model can run: urgent calls are waiting at every turn. A bulk
    call the router already sent runs once it has waited `bulk_max_wait_s`, ahead of them,
    instead of waiting until its clients give up; one that has waited less still goes after them."""
    clock = Clock()
    run = GatedRun(clock, gated=True)
    ex = BatchExecutor(run, max_items=4, clock=clock, bulk_max_wait_s=1.0)
    running = asyncio.ensure_future(ex.submit([1], 1, urgent=True))
    await started(run)
    old_bulk = [asyncio.ensure_future(ex.submit([i], 1)) for i in (2, 3)]
    await asyncio.sleep(0)  # queued at 0
    clock.now = 1.0
    new_bulk = asyncio.ensure_future(ex.submit([4], 1))
    urgent = [asyncio.ensure_future(ex.submit([i], 1, urgent=True)) for i in (8, 9)]
    await asyncio.sleep(0)
    run.release.set()
    results = await asyncio.gather(running, *old_bulk, new_bulk, *urgent)
    assert [r[0] for r in results] == [[10], [20], [30], [40], [80], [90]]
    # The starved bulk call takes the bulk calls behind it along, as any bulk batch does.
    assert run.batches == [[1], [2, 3, 4], [8, 9]]
    fresh = GatedRun(clock, gated=True)
    ex = BatchExecutor(fresh, max_items=4, clock=clock, bulk_max_wait_s=1.0)
    running = asyncio.ensure_future(ex.submit([1], 1, urgent=True))
    await started(fresh)
    bulk = asyncio.ensure_future(ex.submit([2], 1))
    await asyncio.sleep(0)  # queued at 1.0
    clock.now = 1.9
    urgent = [asyncio.ensure_future(ex.submit([8], 1, urgent=True))]
    await asyncio.sleep(0)
    fresh.release.set()
    await asyncio.gather(running, bulk, *urgent)
    assert fresh.batches == [[1], [8], [2]]


def test_an_executor_needs_a_run_function():
    with pytest.raises(ValueError):
        BatchExecutor([], max_items=4)
