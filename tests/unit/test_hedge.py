"""A stalled batch sent once more (serve_app/scheduling/hedge.py), on virtual time: the budget,
the race, and a dispatcher whose batch sits on a replica that is gone."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.contract import BatchReply
from serve_app.scheduling.dispatcher import Dispatcher
from serve_app.scheduling.hedge import HedgeBudget, first_answer
from tests.unit.fakes import virtual_time


def test_the_budget_allows_a_burst_then_a_share_of_the_batches_sent():
    budget = HedgeBudget(ratio=0.25, burst=2)
    assert budget.spend() and budget.spend() and not budget.spend()
    for _ in range(3):
        budget.earn()
    assert not budget.spend()
    budget.earn()
    assert budget.spend() and not budget.spend()
    for _ in range(100):
        budget.earn()
    assert budget.tokens == 2  # never more than the burst


def test_a_budget_without_a_token_to_spend_is_refused():
    with pytest.raises(ValueError):
        HedgeBudget(ratio=0.0)
    with pytest.raises(ValueError):
        HedgeBudget(burst=0.5)


class Calls:
    """Calls that answer after the delays given, in order; a delay of None never answers."""

    def __init__(self, *delays: float | None, fail: tuple[int, ...] = ()) -> None:
        self.delays, self.fail = list(delays), fail
        self.started: list[float] = []
        self.cancelled: list[int] = []

    async def __call__(self) -> str:
        n = len(self.started)
        self.started.append(asyncio.get_running_loop().time())
        delay = self.delays[n]
        try:
            await asyncio.sleep(3600 if delay is None else delay)
        except asyncio.CancelledError:
            self.cancelled.append(n)
            raise
        if n in self.fail:
            raise RuntimeError(f"call {n} failed")
        return f"call {n}"


@virtual_time
async def test_a_call_that_answers_in_time_is_never_sent_twice():
    calls = Calls(0.5)
    assert await first_answer(calls, 1.0, lambda: True) == ("call 0", False)
    assert len(calls.started) == 1


@virtual_time
async def test_a_stalled_call_is_sent_again_and_the_first_answer_wins():
    calls = Calls(None, 0.2)  # the first one's replica is gone: it never answers
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await first_answer(calls, 1.0, lambda: True) == ("call 1", True)
    assert calls.started[1] - start == pytest.approx(1.0)
    assert loop.time() - start == pytest.approx(1.2)
    await asyncio.sleep(0)
    assert calls.cancelled == [0]  # the stalled call does not run on


@virtual_time
async def test_the_stalled_call_may_still_win():
    calls = Calls(1.1, 5.0)
    assert await first_answer(calls, 1.0, lambda: True) == ("call 0", True)
    await asyncio.sleep(0)
    assert calls.cancelled == [1]


@virtual_time
async def test_one_failed_call_leaves_the_other_to_answer_and_two_raise_the_later_failure():
    assert await first_answer(Calls(1.5, 2.0, fail=(0,)), 1.0, lambda: True) == ("call 1", True)
    with pytest.raises(RuntimeError, match="call 1 failed"):
        await first_answer(Calls(1.5, 2.0, fail=(0, 1)), 1.0, lambda: True)


@virtual_time
async def test_without_budget_or_bound_the_stalled_call_is_awaited_alone():
    calls = Calls(3.0)
    assert await first_answer(calls, 1.0, lambda: False) == ("call 0", False)
    calls = Calls(3.0)
    assert await first_answer(calls, None, lambda: True) == ("call 0", False)
    assert len(calls.started) == 1


@virtual_time
async def test_a_dispatchers_batch_on_a_lost_replica_is_answered_by_its_copy():
    """The model's replica on a lost node holds the batch; the copy Serve routes elsewhere answers
    within a few service times, and the stall teaches the service-time estimate nothing."""
    sent: list[list[str]] = []

    async def send(payloads: list[str], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
        sent.append(list(payloads))
        if len(sent) == 2:  # the second batch lands on the lost replica
            await asyncio.sleep(3600)
        await asyncio.sleep(0.1)
        return BatchReply([p.upper() for p in payloads], 0.0, 0.01)

    loop = asyncio.get_running_loop()
    d = Dispatcher("m", send, clock=loop.time)
    assert await d.submit("a", 1) == "A"  # learns a service time of 0.1 s
    before = d.bulk.estimator.batch_s(1)
    start = loop.time()
    assert await d.submit("b", 1) == "B"
    assert loop.time() - start == pytest.approx(1.1, abs=0.05)  # the floor of 1 s, then the copy's 0.1 s
    assert sent[1:] == [["b"], ["b"]] and d.stats.hedged_batches == 1 and d.snapshot()["hedged_batches"] == 1
    assert d.bulk.estimator.batch_s(1) == before
    await asyncio.sleep(0.01)  # the stalled call's cancellation runs
