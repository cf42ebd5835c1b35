import asyncio
import contextvars
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from serve_app.contract import BatchReply, Priority
from serve_app.errors import DeadlineExceeded, InvalidInput, Overloaded, Unavailable
from serve_app.scheduling.dispatcher import Dispatcher, DispatchSettings, RequestTiming
from serve_app.scheduling.estimate import DrainRate
from serve_app.scheduling.protection.limit import AdaptiveLimit
from tests.unit.fakes import virtual_time


def loop_clock() -> Callable[[], float]:
    """The dispatcher reads the event loop's (virtual) clock, as its timers do."""
    return asyncio.get_running_loop().time


class FakeModel:
    """`replicas` replicas, one batch at a time each; a batch of n rows takes base + n * per_item."""

    def __init__(self, replicas: int = 1, base_s: float = 0.01, per_item_s: float = 0.001) -> None:
        self.slots = asyncio.Semaphore(replicas)
        self.base_s, self.per_item_s = base_s, per_item_s
        self.batches: list[list[str]] = []
        self.queued_seen: list[int] = []
        self.max_batch_size: int | None = None

    async def send(
        self, payloads: list[str], queued: int, lane: str = "bulk", traces: list[str | None] | None = None
    ) -> BatchReply:
        arrived = asyncio.get_running_loop().time()
        self.queued_seen.append(queued)
        async with self.slots:
            started = asyncio.get_running_loop().time()
            self.batches.append(list(payloads))
            exec_s = self.base_s + len(payloads) * self.per_item_s
            await asyncio.sleep(exec_s)
        results: list[object] = [InvalidInput(f"bad {p}") if p.startswith("bad") else p.upper() for p in payloads]
        return BatchReply(results, wait_s=started - arrived, exec_s=exec_s, max_batch_size=self.max_batch_size)


def dispatcher(model: FakeModel, **settings: object) -> Dispatcher:
    return Dispatcher("m", model.send, DispatchSettings(**settings), limit=AdaptiveLimit(initial=1), clock=loop_clock())  # type: ignore[arg-type]


@virtual_time
async def test_concurrent_requests_share_batches_and_get_their_own_results():
    model = FakeModel()
    d = dispatcher(model, max_batch_size=8)
    out = await asyncio.gather(*(d.submit(f"r{i}", 1) for i in range(20)))
    assert out == [f"R{i}" for i in range(20)]
    assert len(model.batches) < 20
    assert max(len(b) for b in model.batches) <= 8
    assert d.stats.completed_items == 20 and d.inflight == 0


@virtual_time
async def test_bad_item_fails_alone():
    model = FakeModel()
    d = dispatcher(model)
    results = await asyncio.gather(d.submit("ok", 1), d.submit("bad", 1), return_exceptions=True)
    assert results[0] == "OK"
    assert isinstance(results[1], InvalidInput)


@virtual_time
async def test_whole_batch_failure_reaches_every_request_and_backs_off():
    async def broken(payloads: list[str], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
        raise RuntimeError("replica died")

    d = Dispatcher("m", broken, limit=AdaptiveLimit(initial=4), clock=loop_clock())
    results = await asyncio.gather(*(d.submit(str(i), 1) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    assert d.bulk.limit.value < 4


@virtual_time
async def test_high_priority_jumps_the_queued_low_work():
    model = FakeModel(base_s=0.02)
    d = dispatcher(model, max_batch_size=2, batch_wait_timeout_s=0.0)
    lows = [asyncio.ensure_future(d.submit(f"low{i}", 1, Priority.LOW)) for i in range(10)]
    await asyncio.sleep(0.005)  # the first low batch is running, the rest queue
    high = await d.submit("high", 1, Priority.HIGH)
    assert high == "HIGH"
    order = [p for b in model.batches for p in b]
    assert order.index("high") <= 3, order
    await asyncio.gather(*lows)


@virtual_time
async def test_fifo_serves_in_arrival_order():
    model = FakeModel(base_s=0.02)
    d = dispatcher(model, max_batch_size=2, batch_wait_timeout_s=0.0, policy="fifo")
    lows = [asyncio.ensure_future(d.submit(f"low{i}", 1, Priority.LOW)) for i in range(10)]
    await asyncio.sleep(0.005)
    await d.submit("high", 1, Priority.HIGH)
    order = [p for b in model.batches for p in b]
    assert order.index("high") == 10
    await asyncio.gather(*lows)


@virtual_time
async def test_infeasible_deadline_is_refused_without_model_time():
    model = FakeModel(base_s=0.05)
    # Normal may wait up to two targets: the ten ahead (0.5 s) are admitted.
    d = dispatcher(model, max_batch_size=1, batch_wait_timeout_s=0.0, queue_delay_target_s=0.5)
    await d.submit("learn", 1)  # the estimator needs one batch
    backlog = [asyncio.ensure_future(d.submit(f"b{i}", 1)) for i in range(10)]
    await asyncio.sleep(0)
    now = asyncio.get_running_loop().time()
    with pytest.raises(Overloaded, match="deadline") as refused:
        await d.submit("hopeless", 1, deadline=d.clock() + 0.06)
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s >= 1
    assert d.stats.shed["deadline"] == 1
    assert asyncio.get_running_loop().time() - now < 0.01  # refused at once, not after waiting
    await asyncio.gather(*backlog)
    assert "hopeless" not in [p for b in model.batches for p in b]
    assert sum(len(b) for b in model.batches) == 11


@virtual_time
async def test_a_request_larger_than_the_queue_is_a_400_not_an_overload_to_retry():
    d = dispatcher(FakeModel(), max_batch_size=1, max_queue_items=3)
    with pytest.raises(InvalidInput, match="4 items in one request; the model's queue holds at most 3"):
        await d.submit("too big", 4, Priority.HIGH)
    assert await d.submit("fits", 3) == "FITS" and d.stats.shed == {}


@virtual_time
async def test_full_queue_sheds_low_for_high_and_refuses_equals():
    model = FakeModel(base_s=0.05)
    d = dispatcher(model, max_batch_size=1, batch_wait_timeout_s=0.0, max_queue_items=3)
    running = asyncio.ensure_future(d.submit("running", 1, Priority.LOW))
    await asyncio.sleep(0)
    lows = [asyncio.ensure_future(d.submit(f"low{i}", 1, Priority.LOW)) for i in range(3)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await d.submit("one-too-many", 1, Priority.LOW)
    high = await d.submit("high", 1, Priority.HIGH)
    assert high == "HIGH"
    results = await asyncio.gather(running, *lows, return_exceptions=True)
    shed = [r for r in results if isinstance(r, Overloaded)]
    assert len(shed) == 1 and "higher-priority" in str(shed[0])
    assert d.stats.shed == {"queue_full": 1, "evicted": 1}
    assert d.stats.shed_priority == {"low": 2}  # the refused low and the evicted low; high got through


@virtual_time
async def test_answered_requests_record_their_latency_by_priority():
    model = FakeModel(base_s=0.05, per_item_s=0.0)
    d = dispatcher(model, max_batch_size=1, batch_wait_timeout_s=0.0)
    await asyncio.gather(
        d.submit("a", 1, Priority.LOW), d.submit("b", 1, Priority.HIGH), d.submit("bad", 1), return_exceptions=True
    )
    # One slot, batches of one: the low ran first (0.05 s), then the high waited for it (0.10 s);
    # the bad row failed, so it has no latency to report.
    assert [(p, round(s, 3)) for p, s in d.stats.latency_s] == [("low", 0.05), ("high", 0.1)]


@virtual_time
async def test_deadline_passing_in_the_queue_is_a_504_not_model_time():
    model = FakeModel(base_s=0.05)
    d = dispatcher(model, max_batch_size=1, batch_wait_timeout_s=0.0)
    first = asyncio.ensure_future(d.submit("first", 1))
    await asyncio.sleep(0)
    with pytest.raises(DeadlineExceeded):
        await d.submit("short", 1, deadline=d.clock() + 0.01)  # nothing learned yet, so it is admitted
    await first
    assert ["short"] not in model.batches
    assert d.stats.shed["expired"] == 1


@virtual_time
async def test_a_deadline_is_kept_while_the_model_is_slow_to_answer_as_when_its_replica_starts_from_zero():
    model = FakeModel(base_s=5.0)  # the first batch waits on a replica that takes 5 s to start
    d = dispatcher(model, max_batch_size=1, batch_wait_timeout_s=0.0)
    first = asyncio.ensure_future(d.submit("first", 1, deadline=d.clock() + 0.3))
    await asyncio.sleep(0)
    started = d.clock()
    with pytest.raises(DeadlineExceeded, match="queued"):
        await d.submit("queued", 1, deadline=d.clock() + 0.2)
    assert d.clock() - started == pytest.approx(0.2)  # at its deadline, not when the first batch returns
    with pytest.raises(DeadlineExceeded, match="model ran"):
        await first  # in a batch at the model when its deadline passed
    assert d.clock() - started == pytest.approx(0.3)
    assert d.stats.shed["expired"] == 2 and d.queued_items == 0
    patient = await d.submit("patient", 1, deadline=d.clock() + 60)
    assert patient == "PATIENT" and ["queued"] not in model.batches


@virtual_time
async def test_low_work_overtaken_without_end_gets_a_503_at_the_queue_bound_not_a_hang():
    model = FakeModel(base_s=0.1, per_item_s=0.0)
    # Admission would let it wait: the bound is what ends it, with Retry-After.
    d = dispatcher(
        model, max_batch_size=1, batch_wait_timeout_s=0.0, max_queue_delay_s=60, queue_delay_target_s=60, max_queued_s=1.0
    )

    async def high_client() -> None:
        while d.clock() < 3.0:
            await d.submit("high", 1, Priority.HIGH)

    # More clients than the model has slots: a high request always waits when a batch ends.
    flood = asyncio.gather(*(high_client() for _ in range(8)))
    await asyncio.sleep(0.01)
    started = d.clock()
    with pytest.raises(Overloaded, match=r"queued 1\.0 s") as refused:
        await d.submit("low", 1, Priority.LOW)
    assert d.clock() - started == pytest.approx(1.0) and (refused.value.retry_after_s or 0) >= 1
    assert d.stats.shed["starved"] == 1 and d.items_by_priority()[Priority.LOW] == 0
    await flood
    assert ["low"] not in model.batches
    # A request the model is running is not cut off by the bound: only its own deadline ends it.
    slow = FakeModel(base_s=3.0)
    d = dispatcher(slow, max_batch_size=1, batch_wait_timeout_s=0.0, max_queued_s=1.0)
    assert await d.submit("long", 1, Priority.LOW) == "LONG" and d.stats.shed["starved"] == 0


@virtual_time
async def test_cancelled_request_costs_no_model_time():
    model = FakeModel(base_s=0.05)
    d = dispatcher(model, max_batch_size=1, batch_wait_timeout_s=0.0)
    first = asyncio.ensure_future(d.submit("first", 1))
    gone = asyncio.ensure_future(d.submit("gone", 1))
    await asyncio.sleep(0.01)
    gone.cancel()
    assert await first == "FIRST"
    await asyncio.sleep(0.06)
    assert ["gone"] not in model.batches
    assert d.bulk.queue.items == 0
    assert d.stats.cancelled_items == 1 and d.snapshot()["cancelled_items"] == 1


@virtual_time
async def test_router_queue_depth_travels_with_each_batch():
    model = FakeModel(base_s=0.02)
    d = dispatcher(model, max_batch_size=1, batch_wait_timeout_s=0.0)
    await asyncio.gather(*(d.submit(str(i), 1) for i in range(5)))
    assert max(model.queued_seen) >= 3 and model.queued_seen[-1] == 0


@virtual_time
async def test_live_batching_config_is_adopted_from_replies():
    model = FakeModel()
    model.max_batch_size = 3
    d = dispatcher(model, max_batch_size=8)
    await d.submit("x", 1)
    assert d.settings.max_batch_size == 3
    await asyncio.gather(*(d.submit(str(i), 1) for i in range(12)))
    assert max(len(b) for b in model.batches) <= 3


@virtual_time
async def test_partial_batch_waits_for_more_only_while_the_model_is_busy():
    model = FakeModel(base_s=0.03)
    d = dispatcher(model, max_batch_size=8, batch_wait_timeout_s=0.01)
    d.bulk.limit.value = 2
    await d.submit("alone", 1)  # an idle model gets a lone request at once
    assert model.batches == [["alone"]]
    busy = asyncio.ensure_future(d.submit("busy", 1))
    await asyncio.sleep(0)
    follow = [asyncio.ensure_future(d.submit(f"f{i}", 1)) for i in range(3)]
    await asyncio.gather(busy, *follow)
    assert ["f0", "f1", "f2"] in model.batches


@virtual_time
async def test_breaker_opens_fails_fast_then_a_probe_closes_it():
    calls = 0
    healthy = False

    async def model(payloads: list[str], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
        nonlocal calls
        calls += 1
        if not healthy:
            raise RuntimeError("replica keeps crashing")
        return BatchReply(list(payloads), 0.0, 0.001)

    settings = DispatchSettings(breaker_failures=2, breaker_open_s=0.05, batch_wait_timeout_s=0.0)
    d = Dispatcher("m", model, settings, clock=loop_clock())
    for _ in range(2):
        with pytest.raises(RuntimeError):
            await d.submit("x", 1)
    assert calls == 2
    with pytest.raises(Unavailable, match="circuit open") as refused:
        await d.submit("x", 1)
    retry_after = refused.value.retry_after_s
    assert calls == 2 and retry_after is not None and retry_after >= 1  # failed fast, never reached the model
    assert d.stats.shed["breaker_open"] == 1
    await asyncio.sleep(0.06)
    healthy = True
    assert await d.submit("probe", 1) == "probe"
    assert d.snapshot()["breaker"] == "closed"
    assert await d.submit("y", 1) == "y"


@virtual_time
async def test_a_hung_batch_times_out_and_counts_as_a_failure():
    async def hung(payloads: list[str], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
        await asyncio.sleep(10)
        raise AssertionError("unreachable")

    d = Dispatcher("m", hung, DispatchSettings(batch_timeout_s=0.05, breaker_failures=1), clock=loop_clock())
    with pytest.raises(Unavailable, match="timed out"):
        await d.submit("x", 1)
    assert d.snapshot()["breaker"] == "open"


class LanedModel(FakeModel):
    """One replica with a bulk and an urgent lane, each running one batch at a time."""

    def __init__(self, base_s: float) -> None:
        super().__init__(base_s=base_s, per_item_s=0.0)
        self.lane_slots = {"bulk": asyncio.Semaphore(1), "urgent": asyncio.Semaphore(1)}
        self.lanes_seen: dict[str, list[str]] = {"bulk": [], "urgent": []}

    async def send(
        self, payloads: list[str], queued: int, lane: str = "bulk", traces: list[str | None] | None = None
    ) -> BatchReply:
        arrived = asyncio.get_running_loop().time()
        async with self.lane_slots[lane]:
            started = asyncio.get_running_loop().time()
            self.lanes_seen[lane] += payloads
            await asyncio.sleep(self.base_s)
        return BatchReply([p.upper() for p in payloads], wait_s=started - arrived, exec_s=self.base_s)


@virtual_time
async def test_urgent_lane_serves_high_priority_beside_a_running_bulk_batch():
    model = LanedModel(base_s=0.2)
    settings = DispatchSettings(max_batch_size=2, batch_wait_timeout_s=0.0, urgent_lane=True)
    d = Dispatcher("m", model.send, settings, clock=loop_clock())
    lows = [asyncio.ensure_future(d.submit(f"low{i}", 1, Priority.LOW)) for i in range(6)]
    await asyncio.sleep(0.01)  # a bulk batch is running, more low work queued behind it
    started = asyncio.get_running_loop().time()
    assert await d.submit("high", 1, Priority.HIGH) == "HIGH"
    # One batch time, not the rest of the running bulk batch plus its own.
    assert asyncio.get_running_loop().time() - started < 0.3
    assert model.lanes_seen["urgent"] == ["high"]
    assert "high" not in model.lanes_seen["bulk"]
    assert d.snapshot()["lanes"]["urgent"]["queued_items"] == 0
    await asyncio.gather(*lows)
    assert sorted(model.lanes_seen["bulk"]) == sorted(f"low{i}" for i in range(6))


class WaitingModel:
    """Batches that run next on busy sessions: each reports waiting three times its run."""

    def __init__(self) -> None:
        self.running = 0
        self.most_running = 0

    async def send(self, payloads: list[str], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        await asyncio.sleep(0.1)
        self.running -= 1
        return BatchReply([p.upper() for p in payloads], wait_s=0.3, exec_s=0.1)


async def _together(floor: int, priority: Priority = Priority.HIGH, urgent_lane: bool = True) -> tuple[int, int]:
    """How many of three requests of `priority` sent at once ran together after replies that say
    wait, and the batches in flight their lane then allows."""
    model = WaitingModel()
    settings = DispatchSettings(max_batch_size=1, batch_wait_timeout_s=0.0, urgent_lane=urgent_lane, lane_min_inflight=floor)
    d = Dispatcher("m", model.send, settings, clock=loop_clock())
    for i in range(20):  # the replies teach the limit that every batch waited: it would shrink
        await d.submit(f"h{i}", 1, priority)
    model.most_running = 0
    await asyncio.gather(*(d.submit(f"x{i}", 1, priority) for i in range(3)))
    return model.most_running, d.lane_for(priority).limit.slots


@virtual_time
async def test_urgent_batches_that_wait_at_the_replica_shrink_the_lane_to_one_by_default():
    assert await _together(1) == (1, 1)


@virtual_time
async def test_urgent_batches_run_next_on_bulk_sessions_keep_one_slot_per_session():
    assert await _together(2) == (2, 2)


@virtual_time
async def test_bulk_batches_waiting_behind_urgent_ones_keep_one_slot_per_session():
    """Mostly high priority on shared sessions: lower classes still keep every session busy."""
    assert await _together(2, Priority.LOW) == (2, 2)
    assert await _together(2, Priority.NORMAL) == (2, 2)


class OneSession:
    """One replica session that both lanes' batches run on, one at a time, in the order they came."""

    def __init__(self) -> None:
        self.session = asyncio.Semaphore(1)
        self.ran: list[str] = []
        self.sent: dict[str, float] = {}

    async def send(self, payloads: list[str], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
        arrived = asyncio.get_running_loop().time()
        self.sent.update(dict.fromkeys(payloads, arrived))
        async with self.session:
            started = asyncio.get_running_loop().time()
            self.ran += payloads
            await asyncio.sleep(0.1)
        return BatchReply([p.upper() for p in payloads], wait_s=started - arrived, exec_s=0.1)


def _one_session(shares: bool) -> tuple[OneSession, Dispatcher]:
    """A dispatcher with both lanes, one row a batch, in front of one session."""
    model = OneSession()
    settings = DispatchSettings(max_batch_size=1, batch_wait_timeout_s=0.0, urgent_lane=True, urgent_shares_sessions=shares)
    return model, Dispatcher("m", model.send, settings, clock=loop_clock())


async def _low_then_highs(d: Dispatcher, highs: int) -> tuple[asyncio.Task[Any], list[asyncio.Task[Any]]]:
    """A low request, then `highs` high ones sent together while it runs."""
    first = asyncio.ensure_future(d.submit("low0", 1, Priority.LOW))
    await asyncio.sleep(0.01)
    sent = [asyncio.ensure_future(d.submit(f"high{i}", 1, Priority.HIGH)) for i in range(highs)]
    await asyncio.sleep(0.01)
    return first, sent


async def _session_order(shares: bool) -> list[str]:
    """The order one shared session ran a low request, three high ones sent together while it ran,
    and two more low ones right after them."""
    model, d = _one_session(shares)
    first, highs = await _low_then_highs(d, 3)
    lows = [asyncio.ensure_future(d.submit(f"low{i}", 1, Priority.LOW)) for i in (1, 2)]
    await asyncio.gather(first, *highs, *lows)
    return model.ran


@virtual_time
async def test_on_shared_sessions_bulk_batches_wait_while_high_priority_queues_in_the_router():
    assert await _session_order(shares=True) == ["low0", "high0", "high1", "high2", "low1", "low2"]


@virtual_time
async def test_with_an_urgent_session_of_its_own_the_bulk_lane_never_waits_for_it():
    ran = await _session_order(shares=False)
    assert ran.index("low1") < ran.index("high1")


async def _low_behind_high_backlog(shares: bool) -> tuple[Dispatcher, list[asyncio.Task[Any]]]:
    """A dispatcher on one shared session that learned its batch time, with a low request running
    and twenty high ones (two seconds of work) queued behind it."""
    _, d = _one_session(shares)
    for i in range(5):
        await d.submit(f"warm{i}", 1, Priority.HIGH)
        await d.submit(f"warm{i}", 1, Priority.LOW)
    first, highs = await _low_then_highs(d, 20)
    return d, [first, *highs]


@virtual_time
async def test_while_the_bulk_lane_holds_back_for_high_priority_low_is_refused_at_once():
    d, running = await _low_behind_high_backlog(shares=True)
    with pytest.raises(Overloaded, match="queued ahead"):
        d.precheck(Priority.LOW, None)
    assert d.wait_s(Priority.LOW) > 0.5
    await asyncio.gather(*running)
    d, running = await _low_behind_high_backlog(shares=False)
    d.precheck(Priority.LOW, None)  # its own lane is free
    await asyncio.gather(*running)


@virtual_time
async def test_the_bulk_lane_goes_on_once_the_queued_high_priority_leaves_without_a_batch():
    """High requests whose clients leave free the bulk lane at once, not when the next urgent batch ends."""
    model, d = _one_session(True)
    first, highs = await _low_then_highs(d, 4)
    low = asyncio.ensure_future(d.submit("low1", 1, Priority.LOW))
    await asyncio.sleep(0.01)
    assert "low1" not in model.sent  # held back behind the queued high requests
    left_at = asyncio.get_running_loop().time()
    for task in highs[1:]:  # still in the router's queue: their clients leave
        task.cancel()
    await asyncio.sleep(0.001)
    assert model.sent["low1"] == pytest.approx(left_at, abs=0.001)
    await asyncio.gather(first, highs[0], low)


@virtual_time
async def test_a_pools_bulk_limit_keeps_the_lanes_floor_whatever_the_pool_holds():
    """A multiplexed pool's dispatcher gets a limit whose floor follows the replicas holding the
    model (`hold_at_least` after every reply); beside an urgent lane the lane's own floor stays."""
    settings = DispatchSettings(urgent_lane=True, lane_min_inflight=3)
    d = Dispatcher("m", WaitingModel().send, settings, limit=AdaptiveLimit(initial=1), clock=loop_clock())
    d.bulk.limit.hold_at_least(2)  # one holder
    for i in range(20):  # replies that say every batch waited: the limit shrinks to its floor
        await d.submit(f"l{i}", 1, Priority.LOW)
    assert d.bulk.limit.slots == 3


@virtual_time
async def test_without_an_urgent_lane_the_bulk_limit_is_learned_alone():
    assert await _together(2, Priority.LOW, urgent_lane=False) == (1, 1)


@virtual_time
async def test_fifo_policy_gets_no_floor_from_an_urgent_lane_it_does_not_have():
    settings = DispatchSettings(policy="fifo", urgent_lane=True, lane_min_inflight=3)
    d = Dispatcher("m", WaitingModel().send, settings, clock=loop_clock())
    assert [lane.name for lane in d.lanes] == ["bulk"] and d.bulk.limit.floor == 0.0


@virtual_time
async def test_fifo_policy_has_one_lane_even_when_the_replica_offers_two():
    model = LanedModel(base_s=0.01)
    d = Dispatcher("m", model.send, DispatchSettings(policy="fifo", urgent_lane=True), clock=loop_clock())
    assert [lane.name for lane in d.lanes] == ["bulk"]
    await d.submit("high", 1, Priority.HIGH)
    assert model.lanes_seen == {"bulk": ["high"], "urgent": []}


@virtual_time
async def test_queue_delay_counts_the_wait_not_the_requests_own_batch():
    model = FakeModel(base_s=0.1, per_item_s=0.0)
    d = dispatcher(model, max_batch_size=1, batch_wait_timeout_s=0.0, max_queue_delay_s=0.05)
    await d.submit("learn", 1)  # one batch takes ~0.1 s: longer than the allowed wait
    assert await d.submit("idle", 1) == "IDLE"  # nothing ahead of it: admitted
    backlog = [asyncio.ensure_future(d.submit(f"b{i}", 1)) for i in range(3)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await d.submit("late", 1)
    assert d.stats.shed["queue_delay"] >= 1
    await asyncio.gather(*backlog, return_exceptions=True)


@virtual_time
async def test_request_timing_adds_queue_and_model_time_per_request():
    """A request queued behind a running batch reports that wait as queue time, and its
    own batch's round trip as model time: what the router's Server-Timing header says."""
    model = FakeModel(base_s=0.05, per_item_s=0.0)
    d = dispatcher(model, max_batch_size=1)
    first, second = RequestTiming(), RequestTiming()
    await asyncio.gather(d.submit("a", 1, timing=first), d.submit("b", 1, timing=second))
    assert first.queue_s == 0.0 and second.queue_s == pytest.approx(0.05)
    assert first.model_s == pytest.approx(0.05) and second.model_s == pytest.approx(0.05)
    assert second.replica_s == pytest.approx(0.05)  # the replica's own account of that round trip
    header = second.header(total_s=0.123)
    assert header == "queue;dur=50.00, model;dur=50.00, replica;dur=50.00, total;dur=123.00"


@virtual_time
async def test_precheck_refuses_from_the_class_alone_exactly_when_admission_would():
    """The body-less check (the router's ShedGate) and admission agree on the queue delay,
    and a class with room (high, behind no low work) passes both."""
    model = FakeModel(base_s=0.1, per_item_s=0.0)
    # Low's own budget far off: the bound all classes share decides here.
    d = dispatcher(model, max_batch_size=1, batch_wait_timeout_s=0.0, max_queue_delay_s=0.15, queue_delay_target_s=10)
    await d.submit("learn", 1)
    d.precheck(Priority.LOW, None)  # idle: passes
    # Batches of 0.1 s: some of these run, the rest wait; the queue then holds 0.15 s or more.
    backlog = [asyncio.ensure_future(d.submit(f"b{i}", 1, Priority.LOW)) for i in range(6)]
    await asyncio.sleep(0)
    shed = d.stats.shed["queue_delay"]
    with pytest.raises(Overloaded, match="overloaded") as early:
        d.precheck(Priority.LOW, None)
    assert early.value.retry_after_s is not None
    with pytest.raises(Overloaded):
        await d.submit("late", 1, Priority.LOW)
    assert d.stats.shed["queue_delay"] == shed + 2
    d.precheck(Priority.HIGH, None)  # nothing queued ahead of high: only the running batch
    with pytest.raises(Overloaded, match="deadline"):
        d.precheck(Priority.HIGH, d.clock() + 0.01)
    await asyncio.gather(*backlog, return_exceptions=True)
    assert "late" not in [p for b in model.batches for p in b]


@virtual_time
async def test_precheck_leaves_fifo_to_admission():
    model = FakeModel(base_s=0.1, per_item_s=0.0)
    d = dispatcher(model, policy="fifo", max_batch_size=1, max_queue_delay_s=0.01)
    await d.submit("learn", 1)
    backlog = [asyncio.ensure_future(d.submit(f"b{i}", 1)) for i in range(4)]
    await asyncio.sleep(0)
    assert d.wait_s(Priority.LOW) > 0.01  # a priority dispatcher would refuse this
    d.precheck(Priority.LOW, None)  # fifo has no delay-based refusal
    await asyncio.gather(*backlog)
    assert d.stats.shed == {}


@virtual_time
async def test_precheck_leaves_an_open_circuit_to_admission():
    """With the circuit open, the body-less check says nothing: admission answers with the
    breaker's 503, which the early check cannot predict for a half-open probe."""

    async def broken(payloads: list[str], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
        raise RuntimeError("replica keeps crashing")

    d = Dispatcher("m", broken, DispatchSettings(breaker_failures=1, max_queue_delay_s=0.0), clock=loop_clock())
    with pytest.raises(RuntimeError):
        await d.submit("x", 1)
    assert d.snapshot()["breaker"] == "open"
    d.precheck(Priority.LOW, d.clock())  # an already-passed deadline: refused if the check ran
    with pytest.raises(Unavailable, match="circuit open"):
        await d.submit("y", 1)
    assert d.stats.shed == {"breaker_open": 1}


@virtual_time
async def test_a_saturated_lane_predicts_its_wait_from_the_rate_it_drains():
    """Four batches in flight on one replica: three of them wait at the replica, so service time
    over slots would promise 4x the real drain rate. The rate measured while saturated does not."""
    model = FakeModel(replicas=1, base_s=0.01, per_item_s=0.0)  # 100 rows/s at most
    d = Dispatcher(
        "m",
        model.send,
        DispatchSettings(max_batch_size=1, batch_wait_timeout_s=0.0),
        limit=AdaptiveLimit(4, minimum=4, maximum=4),
        clock=loop_clock(),
    )
    d.bulk.drain = DrainRate(window_s=0.1)
    backlog = [asyncio.ensure_future(d.submit(f"b{i}", 1, Priority.LOW)) for i in range(60)]
    await asyncio.sleep(0.3)
    lane = d.bulk
    assert lane.inflight == 4 and lane.queue.items > 0
    assert 70 <= lane.drain.rate <= 110
    rows = lane.queue.items + lane.inflight_items
    model_based = lane.estimator.wait_s(lane.queue.items, 1, lane.limit.slots, lane.inflight, lane.inflight_items)
    assert d.wait_s(Priority.LOW) == pytest.approx(rows / lane.drain.rate)
    assert d.wait_s(Priority.LOW) > 2.5 * model_based
    await asyncio.gather(*backlog)


class ReplicaDied(Exception):
    """Stands in for Ray's error when the replica running a batch dies."""


@virtual_time
async def test_a_batch_whose_replica_died_runs_once_more_and_nobody_sees_the_death():
    sent: list[list[str]] = []

    async def dies_once(payloads: list[str], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
        sent.append(list(payloads))
        if len(sent) == 1:
            raise ReplicaDied("actor died")
        return BatchReply([p.upper() for p in payloads], 0.0, 0.01)

    d = Dispatcher("m", dies_once, retryable=lambda e: isinstance(e, ReplicaDied), clock=loop_clock())
    assert await asyncio.gather(d.submit("a", 1), d.submit("b", 1)) == ["A", "B"]
    assert sent[0] == sent[1] and d.stats.retried_batches == 1
    assert d.snapshot()["breaker"] == "closed" and d.snapshot()["retried_batches"] == 1


@virtual_time
async def test_a_retry_that_finds_no_live_replica_fails_soon_not_at_the_batch_timeout():
    """The dead replica was the model's only one: Serve holds the retry until a new one is placed.
    The batch fails after a few of its predicted service times, so a route's other tier answers."""
    clock = loop_clock()
    calls = 0

    async def send(payloads: list[str], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(0.05)
            return BatchReply([p.upper() for p in payloads], 0.0, 0.01)  # learns a service time
        if calls == 2:
            raise ReplicaDied("actor died")
        await asyncio.sleep(3600)  # Serve waiting for a replica that is not there yet
        raise AssertionError("unreachable")

    d = Dispatcher("m", send, retryable=lambda e: isinstance(e, ReplicaDied), clock=clock)
    assert await d.submit("a", 1) == "A"
    start = clock()
    with pytest.raises(Unavailable, match="went away") as refused:
        await d.submit("b", 1)
    assert clock() - start <= 1.5 < DispatchSettings().batch_timeout_s
    assert refused.value.retry_after_s == 1.0 and d.stats.retried_batches == 1


@virtual_time
async def test_a_retried_batch_carries_only_the_requests_still_waiting():
    """A request whose client left while its batch's replica was dying is not sent again."""
    sent: list[list[str]] = []
    dying = asyncio.Event()

    async def send(payloads: list[str], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
        sent.append(list(payloads))
        await asyncio.sleep(1.0)
        if payloads == ["a", "b"]:
            dying.set()
            await asyncio.sleep(1.0)
            raise ReplicaDied("actor died")
        return BatchReply([p.upper() for p in payloads], 0.0, 0.01)

    settings = DispatchSettings(max_batch_size=8)
    d = Dispatcher(
        "m", send, settings, limit=AdaptiveLimit(initial=1), retryable=lambda e: isinstance(e, ReplicaDied), clock=loop_clock()
    )
    first = asyncio.ensure_future(d.submit("x", 1))  # holds the one batch slot while a and b queue
    await asyncio.sleep(0.1)
    a, b = asyncio.ensure_future(d.submit("a", 1)), asyncio.ensure_future(d.submit("b", 1))
    await dying.wait()
    a.cancel()  # a's client leaves while the replica dies under the batch
    assert await first == "X" and await b == "B"
    assert sent == [["x"], ["a", "b"], ["b"]] and d.stats.retried_batches == 1
    assert d.inflight == 0


@virtual_time
async def test_a_replica_death_after_every_request_had_its_answer_is_no_model_failure():
    """Nobody waits for a retry, so none is sent, and the death neither opens the breaker nor
    shrinks the in-flight limit (a retry would have found a live replica)."""
    sent: list[list[str]] = []
    dying = asyncio.Event()

    async def send(payloads: list[str], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
        sent.append(list(payloads))
        await asyncio.sleep(1.0)
        if payloads == ["a"]:
            dying.set()
            await asyncio.sleep(1.0)
            raise ReplicaDied("actor died")
        return BatchReply([p.upper() for p in payloads], 0.0, 0.01)

    settings = DispatchSettings(max_batch_size=8, breaker_failures=1)
    limit = AdaptiveLimit(initial=2)
    d = Dispatcher("m", send, settings, limit=limit, retryable=lambda e: isinstance(e, ReplicaDied), clock=loop_clock())
    slots = limit.slots
    first, second = asyncio.ensure_future(d.submit("x", 1)), asyncio.ensure_future(d.submit("y", 1))
    await asyncio.sleep(0.1)
    a = asyncio.ensure_future(d.submit("a", 1))
    await dying.wait()
    a.cancel()
    assert await first == "X" and await second == "Y"
    await asyncio.sleep(2.0)
    assert sent[-1] == ["a"] and d.stats.retried_batches == 0 and d.inflight == 0
    assert d.snapshot()["breaker"] == "closed" and limit.slots >= slots
    assert await d.submit("b", 1) == "B"


@virtual_time
async def test_a_batch_call_runs_outside_the_context_of_the_request_that_released_it():
    """Serve cancels the handle calls made in a request's context when that request ends: a batch
    sent from one client's context would die with it, and take the others in it along."""
    request: contextvars.ContextVar[str | None] = contextvars.ContextVar("request", default=None)
    seen: list[object] = []

    async def send(payloads: list[str], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
        seen.append(request.get())
        return BatchReply([p.upper() for p in payloads], 0.0, 0.01)

    d = dispatcher(FakeModel(), max_batch_size=2)
    d.send = send

    async def client(name: str) -> str:
        request.set(name)
        return await d.submit(name, 1)

    assert await asyncio.gather(client("a"), client("b")) == ["A", "B"]
    assert seen and all(s is None for s in seen)


@virtual_time
async def test_a_batch_whose_call_is_cancelled_under_it_answers_every_request_with_a_503_to_retry():
    async def cancelled(payloads: list[str], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
        raise asyncio.CancelledError  # what a handle call raises when Serve cancels it

    d = dispatcher(FakeModel(), max_batch_size=2)
    d.send = cancelled
    # Bounded (virtual seconds): a batch that answers nobody would otherwise hang here.
    both = asyncio.gather(d.submit("a", 1), d.submit("b", 1), return_exceptions=True)
    results = await asyncio.wait_for(both, 60)
    assert all(isinstance(r, Unavailable) and r.retry_after_s == 1.0 for r in results), results
    assert d.inflight == 0


@virtual_time
async def test_only_a_dead_replica_is_retried_and_only_once():
    calls = 0

    async def always(payloads: list[str], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
        nonlocal calls
        calls += 1
        raise ReplicaDied("actor died") if calls < 10 else RuntimeError("model bug")

    d = Dispatcher("m", always, retryable=lambda e: isinstance(e, ReplicaDied), clock=loop_clock())
    with pytest.raises(Unavailable, match="replica went away") as refused:
        await d.submit("a", 1)
    assert calls == 2  # the retry died too: a 503 to retry is the answer, no third try
    assert refused.value.retry_after_s == 1.0
    calls = 9
    with pytest.raises(RuntimeError, match="model bug"):
        await d.submit("b", 1)
    assert calls == 10  # not a dead replica: never retried


def test_the_router_retries_on_rays_replica_death_errors_only():
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    from serve_app.router.routing.dispatchers import replica_died

    assert replica_died(ActorDiedError()) and replica_died(ActorUnavailableError("gone", None))
    assert not replica_died(InvalidInput("bad")) and not replica_died(TimeoutError())


def test_a_batch_heavier_than_serves_grpc_message_limit_goes_by_reference():
    from serve_app.router.routing.dispatchers import BY_REFERENCE_BYTES, handle_sender, payload_bytes

    class Handle:
        def __init__(self, name: str, calls: list[str]) -> None:
            self.name, self.calls = name, calls
            self.run = self

        def options(self, _by_reference: bool) -> "Handle":
            return Handle("by-reference" if _by_reference else self.name, self.calls)

        async def remote(self, *args: object) -> BatchReply:
            self.calls.append(self.name)
            return BatchReply([None], 0.0, 0.0)

    calls: list[str] = []
    send = handle_sender(Handle("grpc", calls), "r")
    images = [b"x" * (BY_REFERENCE_BYTES // 2)] * 3  # encoded images: their lengths count

    async def batches() -> None:
        await send([images[:1]], 0, "bulk", None)
        await send([images], 0, "bulk", None)
        await send([np.zeros(BY_REFERENCE_BYTES, np.uint8), ["text"]], 0, "bulk", None)

    asyncio.run(batches())
    assert calls == ["grpc", "by-reference", "by-reference"]
    assert payload_bytes([["ab", b"cde"], np.zeros((2, 3), np.float32)]) == 4 * 2 + 3 + 24


def test_the_queue_bound_holds_when_timers_fire_early_as_uvloops_do():
    from tests.unit.fakes import VirtualTimeLoop

    class EarlyTimers(VirtualTimeLoop):
        """Fires every timer 1.5 ms early, as uvloop's whole-millisecond timers may."""

        def call_later(self, delay: float, callback: Any, *args: Any, context: Any = None) -> asyncio.TimerHandle:  # type: ignore[override]
            return super().call_later(max(0.0, delay - 0.0015), callback, *args, context=context)

    async def main() -> None:
        model = FakeModel(base_s=0.5, per_item_s=0.0)
        d = dispatcher(model, max_batch_size=1, batch_wait_timeout_s=0.0, max_queue_delay_s=60, max_queued_s=1.0)
        first = asyncio.ensure_future(d.submit("running", 1, Priority.HIGH))
        await asyncio.sleep(0)
        queued = [asyncio.ensure_future(d.submit(f"q{i}", 1, Priority.LOW)) for i in range(4)]
        results = await asyncio.gather(first, *queued, return_exceptions=True)
        assert results[0] == "RUNNING"
        refused = [r for r in results if isinstance(r, Overloaded)]
        assert refused and d.stats.shed["starved"] == len(refused)  # none left waiting past the bound

    loop = EarlyTimers()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


async def _open_loop(d: Dispatcher, rate: float, mix: dict[Priority, float], seconds: float) -> dict[Priority, list[object]]:
    """Poisson arrivals at `rate` for `seconds` of (virtual) time, each class its share of them,
    each request on its own (as separate clients send them); every request's outcome by class."""
    rng = np.random.default_rng(0)
    classes, weights = list(mix), np.array(list(mix.values())) / sum(mix.values())
    outcomes: dict[Priority, list[object]] = {p: [] for p in classes}

    async def one(priority: Priority) -> None:
        started = d.clock()
        try:
            await d.submit("x", 1, priority)
            outcomes[priority].append(d.clock() - started)
        except Overloaded as e:
            outcomes[priority].append(e)

    tasks = []
    end = d.clock() + seconds
    while d.clock() < end:
        await asyncio.sleep(rng.exponential(1 / rate))
        priority = classes[rng.choice(len(classes), p=weights)]
        tasks.append(asyncio.get_running_loop().create_task(one(priority), context=contextvars.Context()))
    await asyncio.gather(*tasks)
    return outcomes


def _answered(outcomes: list[object]) -> float:
    return sum(not isinstance(o, BaseException) for o in outcomes) / len(outcomes)


@virtual_time
async def test_a_standing_queue_sheds_nothing_below_capacity():
    # One replica, a batch of n rows in 2 + 2n ms: about 440 rows/s at full batches of 8.
    d = dispatcher(
        FakeModel(base_s=0.002, per_item_s=0.002), max_batch_size=8, batch_wait_timeout_s=0.002, queue_delay_target_s=0.1
    )
    outcomes = await _open_loop(d, 300.0, {Priority.HIGH: 10, Priority.NORMAL: 30, Priority.LOW: 60}, seconds=10.0)
    assert all(_answered(o) == 1.0 for o in outcomes.values())
    assert d.stats.shed == {}


@virtual_time
async def test_over_capacity_the_queue_sheds_low_first_and_keeps_its_delay_bounded():
    d = dispatcher(
        FakeModel(base_s=0.002, per_item_s=0.002), max_batch_size=8, batch_wait_timeout_s=0.002, queue_delay_target_s=0.1
    )
    outcomes = await _open_loop(d, 1000.0, {Priority.HIGH: 10, Priority.NORMAL: 30, Priority.LOW: 60}, seconds=10.0)
    high, normal, low = (outcomes[p] for p in (Priority.HIGH, Priority.NORMAL, Priority.LOW))
    assert _answered(high) == 1.0  # never shed by the standing queue
    assert _answered(normal) > _answered(low) and _answered(low) < 0.5
    refusals = d.stats.shed_priority
    assert refusals["low"] > refusals.get("normal", 0) and "high" not in refusals
    # Every refusal at admission, the moment the request came: none after waiting in the queue.
    assert set(d.stats.shed) <= {"queue_budget", "queue_delay"}, d.stats.shed

    # Those answered waited a bounded time, not the many seconds an unbounded queue reaches: normal
    # within its 0.2 s and a few batches; low longer than its 0.1 s, as a low request admitted is
    # still overtaken by the normal and high work that keeps arriving (up to `max_queued_s`).
    def quantile(waits: list[object], q: float) -> float:
        ordered = sorted(o for o in waits if isinstance(o, float))
        return ordered[int(q * len(ordered))]

    assert quantile(normal, 0.99) < 0.5 and quantile(low, 0.5) < 1.0
    # The model stayed busy: the rows answered are most of what it can run (high's batches hold
    # high alone, so their small batches cost it some of the 440 rows/s full batches would give).
    answered = sum(_answered(o) * len(o) for o in outcomes.values())
    assert answered / 10.0 > 300


@virtual_time
async def test_a_low_request_early_in_a_spike_is_refused_on_the_spike_s_rate_not_the_one_before():
    """After a quiet spell, normal arrives faster than the model drains: a low request a fifth of a
    second in would be overtaken by all of it. Admission reads the rate of the spike so far, not
    only the average of the windows before it (which the quiet spell brought down)."""
    d = dispatcher(FakeModel(base_s=0.01, per_item_s=0.001), max_batch_size=8, batch_wait_timeout_s=0.0)
    await _open_loop(d, 600.0, {Priority.NORMAL: 1}, seconds=3.0)  # saturated: the drain rate is learned
    assert d.bulk.drain.rate > 0
    await asyncio.sleep(3.0)
    loop, rng = asyncio.get_running_loop(), np.random.default_rng(1)
    spike = []
    end = d.clock() + 0.2
    while d.clock() < end:
        await asyncio.sleep(rng.exponential(1 / 600.0))
        spike.append(loop.create_task(d.submit("n", 1, Priority.NORMAL), context=contextvars.Context()))
    # On the average alone (no `now`), low would be admitted: its predicted wait fits its budget.
    assert d.bulk.queue_wait_s(Priority.LOW, 8) <= (d.settings.wait_budget_s(Priority.LOW) or 0.0)
    refused = d.stats.shed_priority["low"]
    with pytest.raises(Overloaded, match="queued ahead"):
        await d.submit("low", 1, Priority.LOW)
    assert d.stats.shed_priority["low"] == refused + 1
    await asyncio.gather(*spike, return_exceptions=True)


@virtual_time
async def test_each_class_is_admitted_while_its_predicted_wait_fits_its_budget():
    """Low may be predicted to wait the queue's delay target in the router's queue, normal twice it,
    and high, as every class, no more than `max_queue_delay_s` in all: as work piles up ahead, low is
    refused first, then normal, and high last."""
    model = FakeModel(base_s=0.1, per_item_s=0.0)
    d = dispatcher(model, max_batch_size=1, batch_wait_timeout_s=0.0, queue_delay_target_s=0.25, max_queue_delay_s=1.0)
    await d.submit("learn", 1)  # one batch takes 0.1 s
    backlog: list[asyncio.Future[object]] = []

    def queued_s(priority: Priority) -> float:
        return d.bulk.queue_wait_s(priority, 1)

    async def pile_up_high_until(over: Callable[[], bool]) -> None:
        while not over():
            backlog.append(asyncio.ensure_future(d.submit("h", 1, Priority.HIGH)))
            await asyncio.sleep(0)

    def admitted(priority: Priority) -> bool:
        try:
            d.precheck(priority, None)
        except Overloaded:
            return False
        return True

    await pile_up_high_until(lambda: queued_s(Priority.LOW) > 0.25)
    assert queued_s(Priority.LOW) <= 0.5  # one batch past the target
    assert not admitted(Priority.LOW) and admitted(Priority.NORMAL) and admitted(Priority.HIGH)
    await pile_up_high_until(lambda: queued_s(Priority.NORMAL) > 0.5)
    assert not admitted(Priority.NORMAL) and admitted(Priority.HIGH)
    await pile_up_high_until(lambda: d.wait_s(Priority.HIGH) > 1.0)
    assert not admitted(Priority.HIGH)
    assert d.stats.shed == {"queue_budget": 2, "queue_delay": 1}
    assert d.stats.shed_priority == {"low": 1, "normal": 1, "high": 1}
    await asyncio.gather(*backlog, return_exceptions=True)


@virtual_time
async def test_a_cold_batch_teaches_the_model_cost_without_the_load_it_waited_for():
    """A multiplexed pool's replica loads a model again after evicting it, and that batch waits
    seconds for the load; the estimate that judges deadlines learns the batch's own cost, so the
    warm requests after it are still admitted."""
    loads = iter([0.0, 2.0])  # warm, then loaded again

    async def pool(payloads: list[str], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
        load_s = next(loads, 0.0)
        await asyncio.sleep(load_s + 0.01)
        return BatchReply([p.upper() for p in payloads], 0.0, 0.01, load_s=load_s)

    d = Dispatcher("m", pool, DispatchSettings(max_batch_size=1), clock=loop_clock())
    for _ in range(2):
        assert await d.submit("a", 1) == "A"
    assert d.bulk.estimator.batch_s(1) < 0.05
    now = asyncio.get_running_loop().time()
    assert await d.submit("b", 1, deadline=now + 0.15) == "B"  # one the load, learned, would have refused
