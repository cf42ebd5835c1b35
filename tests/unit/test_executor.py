import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from serve_app.models.executor import BatchExecutor

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Recorder:
    def __init__(self, delay_s: float = 0.02) -> None:
        self.batches: list[list[int]] = []
        self.running = 0
        self.max_running = 0
        self.lock = threading.Lock()
        self.delay_s = delay_s

    def __call__(self, payloads: list[int]) -> list[object]:
        with self.lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        self.batches.append(list(payloads))
        threading.Event().wait(self.delay_s)
        with self.lock:
            self.running -= 1
        return [ValueError("negative") if p < 0 else p * 10 for p in payloads]


async def test_calls_queued_behind_a_running_batch_are_merged_one_batch_at_a_time():
    run = Recorder()
    ex = BatchExecutor(run, max_items=4)
    first = asyncio.ensure_future(ex.submit([1], 1))
    await asyncio.sleep(0.005)
    rest = [asyncio.ensure_future(ex.submit([i], 1)) for i in range(2, 7)]
    results = await asyncio.gather(first, *rest)
    assert [r[0] for r in results] == [[10], [20], [30], [40], [50], [60]]
    assert run.batches == [[1], [2, 3, 4, 5], [6]]
    assert run.max_running == 1
    waits = [r[1] for r in results]
    assert waits[0] < 0.005 and min(waits[1:]) >= 0.01  # queued calls report their wait


async def test_an_error_result_stays_with_its_payload():
    ex = BatchExecutor(Recorder(0.0), max_items=8)
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
    run = Recorder(0.0)
    ex = BatchExecutor(run, max_items=2)
    await asyncio.gather(ex.submit([1, 2, 3], 3), ex.submit([4], 1))
    assert run.batches == [[1, 2, 3], [4]]


async def test_several_runs_take_batches_side_by_side_and_each_runs_one_at_a_time():
    """One worker per run function (one per session): two batches run at once, never two on
    one session, and calls queued behind both still merge."""
    recorders = [Recorder(0.05), Recorder(0.05)]
    pool = ThreadPoolExecutor(2)
    ex = BatchExecutor(list(recorders), max_items=4, pool=pool)
    first = [asyncio.ensure_future(ex.submit([1], 1))]
    await asyncio.sleep(0.005)  # [1] runs: [2] finds the other worker free
    first.append(asyncio.ensure_future(ex.submit([2], 1)))
    await asyncio.sleep(0.005)
    rest = [asyncio.ensure_future(ex.submit([i], 1)) for i in range(3, 9)]
    results = await asyncio.gather(*first, *rest)
    pool.shutdown()
    assert [r[0] for r in results] == [[i * 10] for i in range(1, 9)]
    assert [recorders[0].batches[0], recorders[1].batches[0]] == [[1], [2]]  # side by side, one call each
    assert all(r.max_running == 1 for r in recorders)
    ran = sorted(p for r in recorders for b in r.batches for p in b)
    assert ran == list(range(1, 9))
    assert sum(len(r.batches) for r in recorders) <= 4  # 3..8 merged into batches of up to 4
    # Both ran at once: [2] did not wait for [1]'s batch (50 ms) to end.
    assert results[1][1] < 0.02


def test_an_executor_needs_a_run_function():
    with pytest.raises(ValueError):
        BatchExecutor([], max_items=4)
