"""Cold loads of a multiplexed pool's models (serve_app.scheduling.coldstart): what the router
learns from the pool's answers, and what admission does with it, on a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.contract import BatchReply, Priority
from serve_app.errors import Overloaded
from serve_app.scheduling.coldstart import ColdStart, ModelColdStart
from serve_app.scheduling.dispatcher import Dispatcher, DispatchSettings
from tests.unit.fakes import virtual_time


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_model_no_replica_holds_costs_the_learned_load() -> None:
    clock = Clock()
    pool = ColdStart(clock=clock)
    assert pool.cold_s("m1") == 0.0  # nothing known: admit, and learn
    pool.observe("a", ["m1"], load_s=2.0)
    pool.observe("b", ["m2"])
    assert pool.cold_s("m1") == 0.0 and pool.cold_s("m2") == 0.0
    assert pool.cold_s("m3") == 2.0
    pool.observe("a", ["m3"], load_s=1.0)  # a loaded m3, evicting m1
    assert pool.cold_s("m1") == pytest.approx(1.7) and pool.cold_s("m3") == 0.0  # EWMA of the loads


def test_a_replica_not_heard_from_lately_no_longer_counts() -> None:
    clock = Clock()
    pool = ColdStart(stale_s=30.0, clock=clock)
    pool.observe("a", ["m1"], load_s=2.0)
    clock.now = 20.0
    pool.observe("b", ["m2"])
    clock.now = 40.0  # a's report is stale: m1 may have been evicted by another router's load
    assert pool.cold_s("m1") == 2.0 and pool.cold_s("m2") == 0.0
    clock.now = 100.0  # no replica heard from lately: nothing known
    assert pool.cold_s("m1") == 0.0


def test_a_load_is_started_once_per_load_time_and_counts_down() -> None:
    clock = Clock()
    pool = ColdStart(clock=clock)
    pool.observe("a", ["m1"], load_s=2.0)
    warmed: list[str] = []
    cold = ModelColdStart("m2", pool, lambda: warmed.append("m2"))
    cold.refused()
    cold.refused()
    assert warmed == ["m2"]
    clock.now = 1.5
    assert cold.cold_s() == pytest.approx(0.5)  # the load under way has about half a second left
    clock.now = 5.0  # twice the load time and still not seen held: started again on the next refusal
    cold.refused()
    assert warmed == ["m2", "m2"]
    cold.observe(BatchReply([], 0.0, 0.0, load_s=2.0, replica="b", held=("m2",)))
    assert cold.cold_s() == 0.0


def _model(held: tuple[str, ...]) -> tuple[Dispatcher, ModelColdStart, list[str]]:
    async def send(payloads: list[str], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
        await asyncio.sleep(0.01)
        reply = BatchReply([p.upper() for p in payloads], 0.0, 0.01, replica="a", held=held)
        cold.observe(reply)  # as the router's sender does (DispatcherPool)
        return reply

    loop_clock = asyncio.get_running_loop().time
    pool = ColdStart(clock=loop_clock)
    pool.observe("a", ["other"], load_s=3.0)
    warmed: list[str] = []
    cold = ModelColdStart("m", pool, lambda: warmed.append("m"))
    d = Dispatcher("m", send, DispatchSettings(max_batch_size=4), clock=loop_clock, cold=cold)
    return d, cold, warmed


@virtual_time
async def test_a_deadline_the_load_would_miss_is_refused_at_once_and_the_load_starts():
    d, _, warmed = _model(held=("m",))
    now = asyncio.get_running_loop().time()
    with pytest.raises(Overloaded, match="not loaded on any replica") as refused:
        await d.submit("a", 1, deadline=now + 1.0)
    assert refused.value.retry_after_s == pytest.approx(3.0) and warmed == ["m"]
    assert d.stats.shed["cold_load"] == 1 and d.stats.completed_items == 0
    # Without a deadline the request waits for the load; its answer says the model is held now.
    assert await d.submit("b", 1) == "B"
    assert await d.submit("c", 1, deadline=asyncio.get_running_loop().time() + 1.0) == "C"


@virtual_time
async def test_a_deadline_that_leaves_room_for_the_load_is_admitted():
    d, cold, warmed = _model(held=("m",))
    assert cold.cold_s() == 3.0
    assert await d.submit("a", 1, deadline=asyncio.get_running_loop().time() + 5.0) == "A"
    assert warmed == [] and cold.cold_s() == 0.0


def test_loads_past_two_per_replica_refuse_another_cold_model_until_one_ends() -> None:
    clock = Clock()
    pool = ColdStart(clock=clock)
    pool.observe("a", ["m1"], load_s=1.0)
    pool.observe("b", ["m2"])
    assert pool.loads_ahead_s("m3") is None  # no load in flight
    for model in ("m3", "m4", "m5", "m6"):  # two loads per replica
        pool.sent(model, cold=True)
    pool.sent("m1", cold=False)  # a held model's batch is no load
    assert pool.loads_ahead_s("m7") == pytest.approx(2.0)  # four loads of a second over two replicas
    assert pool.loads_ahead_s("m3") is None  # already loading: its batches join that load
    assert pool.loads_ahead_s("m1") is None and pool.loads_ahead_s("m2") is None  # held
    pool.answered("m5", cold=True)
    assert pool.loads_ahead_s("m7") is None
    assert pool.snapshot()["loading"] == ["m3", "m4", "m6"]


@virtual_time
async def test_a_batch_sent_while_no_replica_holds_its_model_counts_as_a_load_until_answered():
    pool = ColdStart(clock=asyncio.get_running_loop().time)
    pool.observe("a", ["other"], load_s=3.0)
    cold = ModelColdStart("m", pool, lambda: None)
    seen: list[list[str]] = []

    async def send(payloads: list[str], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
        seen.append(sorted(pool._loading))
        await asyncio.sleep(3.0)
        return BatchReply(payloads, 0.0, 0.01, load_s=3.0, replica="a", held=("m",))

    assert await cold.send(send, ["x"], 0, "bulk", None) == BatchReply(["x"], 0.0, 0.01, load_s=3.0, replica="a", held=("m",))
    assert seen == [["m"]] and pool.snapshot()["loading"] == [] and cold.cold_s() == 0.0
    await cold.send(send, ["y"], 0, "bulk", None)  # held now: no load
    assert seen[-1] == []


@virtual_time
async def test_a_cold_model_is_refused_at_once_while_the_pool_loads_enough_and_high_still_goes():
    d, cold, _ = _model(held=("m",))
    for other in ("x1", "x2"):  # one replica known: two loads fill it
        cold.pool.sent(other, cold=True)
    with pytest.raises(Overloaded, match="busy loading other models") as refused:
        await d.submit("a", 1, Priority.LOW)
    assert refused.value.retry_after_s == pytest.approx(6.0) and d.stats.shed["loads_full"] == 1
    assert await d.submit("b", 1, Priority.HIGH) == "B"


def test_the_holders_of_a_model_are_the_replicas_that_reported_it_lately() -> None:
    clock = Clock()
    pool = ColdStart(stale_s=30.0, clock=clock)
    pool.observe("a", ["m1", "m2"])
    pool.observe("b", ["m1"])
    assert (pool.holders("m1"), pool.holders("m2"), pool.holders("m3")) == (2, 1, 0)
    clock.now = 40.0
    pool.observe("b", ["m1"])
    assert pool.holders("m1") == 1  # a's report is stale
