"""Per-model dispatcher: admission, the priority queue, and batch release under a learned limit.

The router holds every request here and releases work to the model only
while it has a free slot, as one batch (one handle call) at a time. Batches
therefore form in the router, where priority and deadlines are known, and
never queue in Ray's FIFO queues behind a flood of low-priority work. One
handle call per batch instead of per request also cuts the per-request CPU
of the router->model hop (see benchmarks/results/profile/).

No Ray here: `send` is any coroutine that runs a batch, so the policy is
tested with a fake model.

Lanes: with `urgent_lane` on, high-priority work has a lane of its own (its
own queue, limit and latency model) that the replica runs on a second
session beside the bulk one, at a higher CPU priority (see
serve_app/models/executor.py). A high-priority request then never waits for
a running low-priority batch, which is what keeps its latency flat under a
flood: a batch cannot be interrupted once ONNX Runtime runs it.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from serve_app.contract import BULK, URGENT, BatchReply, Priority, SendBatch
from serve_app.errors import DeadlineExceeded, Overloaded, ServeAppError, Unavailable
from serve_app.observability import tracing
from serve_app.scheduling.coldstart import ModelColdStart
from serve_app.scheduling.estimate import ArrivalRates, DrainRate, LatencyEstimator
from serve_app.scheduling.hedge import HedgeBudget, first_answer
from serve_app.scheduling.protection.breaker import BreakerState, CircuitBreaker
from serve_app.scheduling.protection.limit import AdaptiveLimit
from serve_app.scheduling.queue import QueueFull, QueuePolicy, RequestQueue, Ticket, make_queue
from serve_app.scheduling.waits import WaitBounds


@dataclass
class RequestTiming:
    """Where one request's time went in the router, summed over the models it visited
    (a route visits two): what the `Server-Timing` response header reports."""

    queue_s: float = 0.0  # waiting in the router's queues
    model_s: float = 0.0  # round trips to the model replicas
    replica_s: float = 0.0  # of those, the replicas' own time (their queue and the run)

    def add(self, ticket: Ticket) -> None:
        self.queue_s += ticket.queued_s
        self.model_s += ticket.model_s
        self.replica_s += ticket.replica_s

    def header(self, total_s: float) -> str:
        """W3C Server-Timing, in milliseconds; `total` is the router's whole handling. `model` less
        `replica` is the calls' transport and the router's own delay in taking the answers."""
        return (
            f"queue;dur={self.queue_s * 1e3:.2f}, model;dur={self.model_s * 1e3:.2f}, "
            f"replica;dur={self.replica_s * 1e3:.2f}, total;dur={total_s * 1e3:.2f}"
        )


@dataclass
class DispatchSettings:
    policy: QueuePolicy = "priority"
    max_queue_items: int = 1024
    max_queue_delay_s: float = 2.0
    max_queued_s: float = 10.0  # the longest a ticket stays queued, deadline or not: then a 503
    # How long low may be predicted to wait (more than two full batches; normal twice it): `wait_budget_s`.
    queue_delay_target_s: float = 0.5
    max_batch_size: int = 16
    batch_wait_timeout_s: float = 0.004
    batch_timeout_s: float = 30.0  # a batch taking longer counts as a model failure
    # A batch sent again after its replica died waits at most this many times its predicted service
    # time (and never less than `retry_floor_s`), not `batch_timeout_s`: when the dead replica was
    # the model's only one, Serve's handle keeps the call until the controller has placed a new one,
    # and a route's other tier should answer long before that. A first call unanswered that long
    # gets a copy sent beside it (scheduling/hedge.py): its replica may be on a node that is gone.
    retry_factor: float = 4.0
    retry_floor_s: float = 1.0
    breaker_failures: int = 5  # failed batches in a row that open the circuit
    breaker_open_s: float = 5.0
    urgent_lane: bool = False  # the replica runs high-priority batches on a lane of their own
    # Each lane's batches in flight never go below this. Where urgent batches run next on the bulk
    # lane's sessions (`urgent_session: false`), a batch of either lane waits for a running batch of
    # the other, which the learned limit would read as a queue and answer with one batch at a time:
    # high priority would queue behind high priority in the router, and with high the most of the
    # traffic, bulk batches would keep one session of several busy. One per session keeps them all going.
    lane_min_inflight: int = 1
    # Urgent batches run next on the bulk lane's sessions (`urgent_session: false`). While high
    # priority waits in the router with every urgent slot taken, the bulk lane sends nothing: a
    # session that frees then takes the next urgent batch, not a bulk one sent ahead of it, so high
    # priority is served first when the model cannot serve every class.
    urgent_shares_sessions: bool = False

    def wait_budget_s(self, priority: Priority) -> float | None:
        """The longest a request of this class may be predicted to wait in the router's queue and
        still be admitted: low the queue's delay target, normal twice it, high no budget of its own
        (only `max_queue_delay_s`, as every class). As the queue grows past the capacity, low is
        refused first, normal only once high and normal alone fill it; the queue then holds about a
        target's worth of work beside the batches in flight, so the model never runs out of it."""
        if priority == Priority.LOW:
            return self.queue_delay_target_s
        if priority == Priority.NORMAL:
            return 2 * self.queue_delay_target_s
        return None

    def adopt(self, reply: BatchReply) -> None:
        """Follow the replica's live batching config (`user_config` is set on the model)."""
        if reply.max_batch_size is not None:
            self.max_batch_size = reply.max_batch_size
        if reply.batch_wait_timeout_s is not None:
            self.batch_wait_timeout_s = reply.batch_wait_timeout_s


@dataclass
class Lane:
    """One path to the model: a queue, the batches in flight on it, and what it learned."""

    name: str
    queue: RequestQueue
    limit: AdaptiveLimit
    estimator: LatencyEstimator = field(default_factory=LatencyEstimator)
    drain: DrainRate = field(default_factory=DrainRate)
    arrivals: ArrivalRates = field(default_factory=ArrivalRates)
    inflight: int = 0
    inflight_items: int = 0
    timer: asyncio.TimerHandle | None = None
    bounds: WaitBounds | None = None  # how long its requests may wait (set by the dispatcher)
    # Recent batches as (router queue s, round trip s, replica wait s, exec s): where latency goes.
    recent: deque[tuple[float, float, float, float]] = field(default_factory=lambda: deque(maxlen=512))

    @property
    def saturated(self) -> bool:
        return self.inflight >= self.limit.slots

    def wait_s(self, priority: Priority, max_batch_size: int) -> float:
        """Predicted seconds before a request of this class would start its own batch."""
        ahead = self.queue.items_ahead(priority)
        if self.saturated:
            # Every slot busy: the rows ahead and in flight leave at the rate the lane delivers.
            drained = self.drain.seconds_for(ahead + self.inflight_items)
            if drained is not None:
                return drained
        return self.estimator.wait_s(ahead, max_batch_size, self.limit.slots, self.inflight, self.inflight_items)

    def queue_wait_s(self, priority: Priority, max_batch_size: int, now: float | None = None) -> float:
        """Predicted seconds a request of this class would spend in the router's queue before its
        batch is sent: nothing while a slot is free; else the rows ahead leave as batches in
        flight complete, at the rate the lane delivers less the rate of the classes that will
        overtake it meanwhile (infinite when those alone take all of it; `ArrivalRates.above`)."""
        ahead = self.queue.items_ahead(priority)
        if not ahead or not self.saturated:
            return 0.0
        if self.drain.rate <= 0:  # no saturated window measured yet: the batches' own time
            return self.estimator.drain_s(ahead, max_batch_size, self.limit.slots)
        left = self.drain.rate - self.arrivals.above(priority, now)
        return ahead / left if left > 0 else float("inf")

    def retry_after_s(self, max_batch_size: int) -> float:
        """When a refused client may try again: once what is queued and in flight has drained."""
        drained = self.drain.seconds_for(self.queue.items + self.inflight_items)
        if drained is None:
            drained = self.estimator.drain_s(self.queue.items, max_batch_size, self.limit.slots)
        return max(1.0, drained)

    def learn(self, reply: BatchReply, items: int, rtt: float, queued_s: float, inflight: int, now: float) -> None:
        """What an answered batch teaches: the limit, the latency model, the drain rate."""
        self.limit.on_batch(reply.wait_s, reply.exec_s, inflight)
        self.estimator.observe(items, rtt - reply.load_s, reply.wait_s)
        # `self.inflight` still counts this batch: the lane was full if it is at its limit now.
        self.drain.on_completion(items, now, bool(self.queue.items) and self.saturated)
        self.recent.append((queued_s, rtt, reply.wait_s, reply.exec_s))

    def snapshot(self, predicted_wait_s: float, max_batch_size: int) -> dict[str, Any]:
        return {
            "queued_items": self.queue.items,
            "inflight_batches": self.inflight,
            "inflight_limit": round(self.limit.value, 2),
            "replica_queue_estimate": round(self.limit.queue_estimate, 3),
            "drain_rows_per_s": round(self.drain.rate, 2),
            "predicted_wait_ms": round(predicted_wait_s * 1e3, 1),
            "batch_ms": {
                "one": round(self.estimator.batch_s(1) * 1e3, 3),
                "full": round(self.estimator.batch_s(max_batch_size) * 1e3, 3),
            },
            "recent_ms": self.latency_breakdown(),
        }

    def latency_breakdown(self) -> dict[str, dict[str, float]]:
        if not self.recent:
            return {}
        columns = zip(*self.recent, strict=True)
        names = ("router_queue", "round_trip", "replica_wait", "exec")
        return {
            n: {"p50": round(_quantile(c, 0.5) * 1e3, 2), "p99": round(_quantile(c, 0.99) * 1e3, 2)}
            for n, c in zip(names, columns, strict=True)
        }


def _quantile(values: tuple[float, ...], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class DispatchStats:
    """Monotonic counters; the metrics exporter reads differences."""

    admitted: Counter[str] = field(default_factory=Counter)  # by priority name
    shed: Counter[str] = field(default_factory=Counter)  # by reason
    shed_priority: Counter[str] = field(default_factory=Counter)  # the same refusals, by priority name
    completed_items: int = 0
    cancelled_items: int = 0  # dropped from the queue because their caller went away
    retried_batches: int = 0  # sent again after the replica running them died
    hedged_batches: int = 0  # sent again beside a call that stalled (scheduling/hedge.py)
    batches: int = 0
    queue_wait_s: list[float] = field(default_factory=list)  # drained by the exporter
    # (priority name, seconds from admission to answer) per answered request; drained by the exporter
    latency_s: list[tuple[str, float]] = field(default_factory=list)

    def count_shed(self, reason: str, priority: Priority) -> None:
        self.shed[reason] += 1
        self.shed_priority[priority.name.lower()] += 1

    def counts(self) -> dict[str, Any]:
        return {
            "admitted": dict(self.admitted),
            "shed": dict(self.shed),
            "shed_by_priority": dict(self.shed_priority),
            "completed_items": self.completed_items,
            "cancelled_items": self.cancelled_items,
            "retried_batches": self.retried_batches,
            "hedged_batches": self.hedged_batches,
            "batches": self.batches,
        }


class Dispatcher:
    """Admits requests for one model, queues them, and sends them in batches."""

    def __init__(
        self,
        model: str,
        send: SendBatch,
        settings: DispatchSettings | None = None,
        limit: AdaptiveLimit | None = None,
        clock: Callable[[], float] = time.monotonic,
        retryable: Callable[[Exception], bool] = lambda error: False,
        cold: ModelColdStart | None = None,
    ) -> None:
        self.model = model
        self.send = send
        self.cold = cold  # a multiplexed pool's model: what a load adds (its replies feed it: DispatcherPool)
        self.settings = s = settings or DispatchSettings()
        self.bulk = _bulk_lane(s, limit)
        self.lanes = [_urgent_lane(s), self.bulk] if s.urgent_lane and self.prioritized else [self.bulk]
        self.breaker = CircuitBreaker(s.breaker_failures, s.breaker_open_s, clock)
        self.hedges = HedgeBudget()
        self.clock = clock
        # Errors after which a batch may run again elsewhere: the replica died, not the model
        # refused it. Classification has no side effects, so a second run harms nobody.
        self.retryable = retryable
        self.stats = DispatchStats()
        self._tasks: set[asyncio.Task[None]] = set()
        for lane in self.lanes:
            expire, starve = partial(self._expire, lane), partial(self._starve, lane)
            lane.bounds = WaitBounds(lane.queue.queued, s.max_queued_s, clock, expire, starve)

    @property
    def prioritized(self) -> bool:
        """Admission by class and deadline (and so shedding) is the queue policy's to say."""
        return self.bulk.queue.prioritized

    def lane_for(self, priority: Priority) -> Lane:
        return self.lanes[0] if priority == Priority.HIGH else self.bulk

    @property
    def inflight(self) -> int:
        return sum(lane.inflight for lane in self.lanes)

    @property
    def queued_items(self) -> int:
        return sum(lane.queue.items for lane in self.lanes)

    def items_by_priority(self) -> dict[Priority, int]:
        return {p: sum(lane.queue.items_by_priority[p] for lane in self.lanes) for p in Priority}

    # -- admission -------------------------------------------------------------

    def wait_s(self, priority: Priority) -> float:
        """Predicted seconds before a request of this class would start its own batch."""
        return self.lane_for(priority).wait_s(priority, self.settings.max_batch_size) + _held_s(self, priority)

    def _retry_after(self, lane: Lane) -> float:
        return lane.retry_after_s(self.settings.max_batch_size)

    def _refuse(self, lane: Lane, reason: str, priority: Priority, message: str) -> Overloaded:
        self.stats.count_shed(reason, priority)
        return Overloaded(f"{self.model}: {message}", retry_after_s=self._retry_after(lane))

    def _check(self, lane: Lane, items: int, priority: Priority, deadline: float | None, now: float) -> None:
        """Refuse (raise Overloaded) a request of `items` rows that cannot be served in time, or of a
        class whose budget the wait in the router's queue exceeds (`DispatchSettings.wait_budget_s`).
        Deterministic: the same request is judged the same from its headers and at admission."""
        waiting = self.wait_s(priority)
        predicted = waiting + lane.estimator.batch_s(items)
        if deadline is not None and now + predicted > deadline:
            raise self._refuse(lane, "deadline", priority, f"cannot meet the deadline (about {predicted * 1e3:.0f} ms of work)")
        _check_cold(self, priority, None if deadline is None else deadline - now - predicted)
        budget = self.settings.wait_budget_s(priority)
        if budget is not None:
            # Predicted from the rows ahead, and seen: the oldest of this class still queued has waited
            # past the budget (classes above kept overtaking it, which no prediction of the rows ahead sees).
            ahead = lane.queue_wait_s(priority, self.settings.max_batch_size, now) + _held_s(self, priority)
            queued = max(ahead, lane.queue.oldest_wait(now, priority))
            if queued > budget:
                raise self._refuse(lane, "queue_budget", priority, f"overloaded (about {queued:.1f} s queued ahead)")
        # The wait, not the request's own batch: an estimate inflated by one slow batch would otherwise
        # refuse everything, and with nothing admitted it never learns that the model got fast again.
        if waiting > self.settings.max_queue_delay_s:
            raise self._refuse(lane, "queue_delay", priority, f"overloaded (about {waiting:.1f} s of work queued)")

    def precheck(self, priority: Priority, deadline: float | None) -> None:
        """What admission would say to the smallest request (one row) of this class, before
        its body is read: raises Overloaded if even that is refused. Exact for the queue
        delay (the wait ahead does not depend on the request's size) and a lower bound for
        the deadline (more rows finish later), so it never refuses what `admit` would take."""
        if self.prioritized and self.breaker.state == BreakerState.CLOSED:
            self._check(self.lane_for(priority), 1, priority, deadline, self.clock())

    def admit(self, payload: Any, items: int, priority: Priority, deadline: float | None) -> Ticket:
        """Queue a request or raise Overloaded; never spends model time on a refused one."""
        now = self.clock()
        lane = self.lane_for(priority)
        if not self.breaker.allow():
            self.stats.count_shed("breaker_open", priority)
            raise Unavailable(
                f"{self.model}: circuit open after repeated failures", retry_after_s=max(1.0, self.breaker.retry_after_s())
            )
        if self.prioritized:
            self._check(lane, items, priority, deadline, now)
        lane.arrivals.on_admission(priority, items, now)
        ticket = Ticket(payload, items, priority, deadline if self.prioritized else None, now, trace=tracing.current())
        try:
            evicted = lane.queue.push(ticket)
        except QueueFull as e:
            raise self._refuse(lane, "queue_full", priority, f"overloaded ({e})") from None
        loop = asyncio.get_running_loop()
        ticket.result = loop.create_future()
        if self.prioritized and lane.bounds is not None:  # the FIFO baseline keeps a plain queue's behaviour
            lane.bounds.admitted(loop, ticket)
        for victim in evicted:
            self.stats.count_shed("evicted", victim.priority)
            victim.result.set_exception(
                Overloaded(f"{self.model}: shed for higher-priority work", retry_after_s=self._retry_after(lane))
            )
        self.stats.admitted[priority.name.lower()] += 1
        self._dispatch(lane)
        return ticket

    def _expire(self, lane: Lane, ticket: Ticket, queued: bool) -> None:
        """A 504 when the ticket's deadline passes, queued or in a batch not answered yet (a replica
        starting from zero)."""
        if queued:
            _unqueue(self, lane, ticket)
        self.stats.count_shed("expired", ticket.priority)
        where = "queued" if queued else "the model ran"
        ticket.result.set_exception(DeadlineExceeded(f"{self.model}: deadline passed while {where}"))

    def _starve(self, lane: Lane, ticket: Ticket) -> None:
        """A 503 with Retry-After when still queued `max_queued_s` after admission (higher classes
        kept arriving ahead of it), rather than holding its memory until its client gives up."""
        _unqueue(self, lane, ticket)
        self.stats.count_shed("starved", ticket.priority)
        waited = self.clock() - ticket.enqueued
        error = Overloaded(f"{self.model}: overloaded (queued {waited:.1f} s)", retry_after_s=self._retry_after(lane))
        ticket.result.set_exception(error)

    async def submit(
        self,
        payload: Any,
        items: int,
        priority: Priority = Priority.NORMAL,
        deadline: float | None = None,
        timing: RequestTiming | None = None,
    ) -> Any:
        """Admit, wait for the batch, return this request's result (or raise its error).
        `timing`, when given, gets this request's queue and model time added."""
        ticket = self.admit(payload, items, priority, deadline)
        try:
            result = await ticket.result
            if timing is not None:
                timing.add(ticket)
            return result
        except asyncio.CancelledError:
            # The client went away: free its place so it costs no model time.
            if not ticket.done:
                self.stats.cancelled_items += ticket.items
            _unqueue(self, self.lane_for(ticket.priority), ticket)
            ticket.result.cancel()  # nobody waits for it now: its deadline timer goes too
            raise

    def snapshot(self) -> dict[str, Any]:
        """What an operator wants to see about this queue right now (the router's /router/status)."""
        return _snapshot(self)

    # -- release -----------------------------------------------------------------

    def _dispatch(self, lane: Lane) -> None:
        """Send batches on `lane` while it has free slots. Runs on every admission and completion."""
        s, queue = self.settings, lane.queue
        while queue.items and lane.inflight < lane.limit.slots and not _yields(self, lane):
            now = self.clock()
            if lane.inflight and queue.items < s.max_batch_size:
                # A batch is running anyway: let this one fill for up to the batch timeout.
                waited = queue.oldest_wait(now)
                if waited < s.batch_wait_timeout_s - 1e-6:  # a timer may fire a hair early: that is on time
                    self._arm_timer(lane, s.batch_wait_timeout_s - waited)
                    return
            batch, expired = queue.pop_batch(s.max_batch_size, now)
            for ticket in expired:
                self.stats.count_shed("expired", ticket.priority)
                ticket.result.set_exception(DeadlineExceeded(f"{self.model}: deadline passed while queued"))
            if not batch:
                continue
            lane.inflight += 1
            lane.inflight_items += sum(t.items for t in batch)
            task = _detached(self._run(lane, batch, lane.inflight, now))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _arm_timer(self, lane: Lane, delay_s: float) -> None:
        if lane.timer is None:

            def fire() -> None:
                lane.timer = None
                self._dispatch(lane)

            lane.timer = asyncio.get_running_loop().call_later(delay_s, fire, context=contextvars.Context())  # see _detached

    async def _run(self, lane: Lane, batch: list[Ticket], inflight: int, sent: float) -> None:
        for ticket in batch:
            ticket.queued_s = sent - ticket.enqueued
            self.stats.queue_wait_s.append(ticket.queued_s)
        queued_s = max(t.queued_s for t in batch)
        spans = BatchSpans(self.model, lane.name, batch, sent) if any(t.trace is not None for t in batch) else None
        try:
            reply, sent_batch, resent = await _send(self, lane, batch, spans)
        except Exception as e:  # the whole batch failed: every request gets the error
            if spans is not None:
                spans.end(self.clock(), error=e)
            e = _to_retry(self.model, e, self.settings.batch_timeout_s, self.retryable(e))
            if _model_failed(e):
                lane.limit.on_failure()
                self.breaker.on_failure()
            _fail(batch, e)
        else:
            self.breaker.on_success()
            rtt = self.clock() - sent
            if spans is not None:
                spans.end(sent + rtt, reply=reply, sent=sent_batch)
            items = sum(t.items for t in sent_batch)
            if not resent:  # a resent batch's round trip holds the stall or the death: not the model's pace
                lane.learn(reply, items, rtt, queued_s, inflight, self.clock())
            self.settings.adopt(reply)
            self.stats.completed_items += items
            self.stats.batches += 1
            _answer(sent_batch, reply, rtt, self.clock(), self.stats)
        finally:
            # Whatever ended the call (this task cancelled, say), no request is left without an answer.
            _fail(batch, Unavailable(f"{self.model}: the batch ended without an answer", retry_after_s=1.0))
            lane.inflight -= 1
            lane.inflight_items -= sum(t.items for t in batch)
            self._dispatch(lane)
            _wake_bulk(self, lane)


def _bulk_lane(s: DispatchSettings, limit: AdaptiveLimit | None) -> Lane:
    """The lane of every class below the urgent lane's (of all of them where there is none), its
    batches in flight learned by `limit` (a new one when None); beside an urgent lane never below
    `lane_min_inflight`."""
    queue, limit = make_queue(s.policy, s.max_queue_items), limit or AdaptiveLimit()
    if s.urgent_lane and queue.prioritized and s.lane_min_inflight > 1:
        # A base a pool's floor (which follows its holders) never lowers.
        limit.base_floor = s.lane_min_inflight
        limit.hold_at_least(s.lane_min_inflight)
    return Lane(BULK, queue, limit)


def _urgent_lane(s: DispatchSettings) -> Lane:
    """High priority's lane, with a bound of its own: its work neither evicts nor is crowded out by
    the bulk queue, and its batches in flight never go below `lane_min_inflight`."""
    limit = AdaptiveLimit(initial=s.lane_min_inflight, floor=s.lane_min_inflight)
    return Lane(URGENT, make_queue(s.policy, s.max_queue_items), limit)


def _yields(d: Dispatcher, lane: Lane) -> bool:
    """Whether `lane` holds its next batch back for the urgent lane, whose batches run on its
    sessions (`DispatchSettings.urgent_shares_sessions`): that lane has every slot taken and high
    priority still queued."""
    if lane is not d.bulk or len(d.lanes) == 1 or not d.settings.urgent_shares_sessions:
        return False
    urgent = d.lanes[0]
    return urgent.saturated and urgent.queue.items > 0


def _held_s(d: Dispatcher, priority: Priority) -> float:
    """How long the lane of `priority` is predicted to hold its batches back for the urgent lane's
    queue (`_yields`)."""
    return d.lanes[0].wait_s(Priority.HIGH, d.settings.max_batch_size) if _yields(d, d.lane_for(priority)) else 0.0


def _wake_bulk(d: Dispatcher, lane: Lane) -> None:
    """After the urgent lane lost a batch or a queued request: the bulk lane may have held back for it."""
    if lane is not d.bulk:
        d._dispatch(d.bulk)


def _unqueue(d: Dispatcher, lane: Lane, ticket: Ticket) -> None:
    lane.queue.cancel(ticket)
    _wake_bulk(d, lane)


def standing_s(d: Dispatcher) -> float:
    """The age of the oldest request in a dispatcher's bulk queue now (0 when empty): the delay a
    route's degradation follows (serve_app/scheduling/protection/degrade.py)."""
    return d.bulk.queue.oldest_wait(d.clock())


def _snapshot(d: Dispatcher) -> dict[str, Any]:
    s = d.settings
    return {
        "policy": d.bulk.queue.policy,
        "queued_items": {p.name.lower(): n for p, n in d.items_by_priority().items()},
        "breaker": d.breaker.state.name.lower(),
        "max_batch_size": s.max_batch_size,
        "lanes": {
            lane.name: lane.snapshot(d.wait_s(Priority.LOW if lane is d.bulk else Priority.HIGH), s.max_batch_size)
            for lane in d.lanes
        },
        **d.stats.counts(),
    }


def _check_cold(d: Dispatcher, priority: Priority, room_s: float | None) -> None:
    """A request with `room_s` to spare past its predicted answer, late only for its model's load:
    refused now rather than after waiting for it; the load starts anyway, so that a retry after it
    finds the model loaded. A request for a model that must load while the pool's replicas have
    all the loads they can take (coldstart.py) is refused too, the highest class excepted."""
    if d.cold is None:
        return
    if priority != Priority.HIGH and (ahead_s := d.cold.loads_ahead_s()) is not None:
        d.stats.count_shed("loads_full", priority)
        raise Overloaded(
            f"{d.model}: not loaded on any replica, and the pool is busy loading other models (about {ahead_s:.1f} s)",
            retry_after_s=max(1.0, ahead_s),
        )
    if room_s is None or (loading := d.cold.cold_s()) <= room_s:
        return
    d.cold.refused()
    d.stats.count_shed("cold_load", priority)
    raise Overloaded(
        f"{d.model}: not loaded on any replica, and its load (about {loading:.1f} s) would miss the deadline",
        retry_after_s=max(1.0, loading),
    )


def _detached(run: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """A batch's task, in a context of its own rather than that of the request whose admission or
    timer released it: Serve ties a handle call to the request whose context makes it, and cancels
    the call when that request ends, which would cancel a batch holding other clients' requests."""
    return asyncio.get_running_loop().create_task(run, context=contextvars.Context())


async def _call(
    d: Dispatcher, lane: str, spans: BatchSpans | None, batch: list[Ticket], timeout_s: float | None = None
) -> BatchReply:
    traces = spans.traceparents(batch) if spans is not None else None
    send = d.send([t.payload for t in batch], d.queued_items, lane, traces)
    return await asyncio.wait_for(send, d.settings.batch_timeout_s if timeout_s is None else timeout_s)


def _bound_s(s: DispatchSettings, lane: Lane, batch: list[Ticket]) -> float:
    """A few of the batch's predicted service times (never less than the floor, never more than the batch timeout)."""
    return min(max(s.retry_floor_s, s.retry_factor * lane.estimator.batch_s(sum(t.items for t in batch))), s.batch_timeout_s)


def _stall_s(s: DispatchSettings, lane: Lane, batch: list[Ticket]) -> float | None:
    """How long the batch's call may go unanswered before a copy is sent beside it; None (never)
    until the lane has learned a service time: a cold replica's first batches are slow by nature."""
    return _bound_s(s, lane, batch) if lane.estimator.samples else None


async def _send(
    d: Dispatcher, lane: Lane, batch: list[Ticket], spans: BatchSpans | None
) -> tuple[BatchReply, list[Ticket], bool]:
    """The batch's round trip, the tickets it carried, and whether it was sent more than once:
    if it stalls past a few predicted service times, sent again beside the first call
    (scheduling/hedge.py); if its replica died under it, sent once more (Serve routes it to a
    live replica) with the requests still waiting for an answer."""
    d.hedges.earn()
    try:
        call = lambda: _call(d, lane.name, spans, batch)  # noqa: E731 (the same call, once or twice)
        reply, hedged = await first_answer(call, _stall_s(d.settings, lane, batch), d.hedges.spend)
    except Exception as e:
        if not d.retryable(e):
            raise
        if not (again := [t for t in batch if not t.result.done()]):  # a request whose client left has its answer
            raise NobodyWaits(d.model) from e
    else:
        if hedged:
            d.stats.hedged_batches += 1
        return reply, batch, hedged
    d.stats.retried_batches += 1
    return await _send_again(d, lane, spans, again), again, True


async def _send_again(d: Dispatcher, lane: Lane, spans: BatchSpans | None, batch: list[Ticket]) -> BatchReply:
    """A batch whose replica died, sent once more, waiting a few predicted service times at most."""
    bound = _bound_s(d.settings, lane, batch)
    try:
        return await _call(d, lane.name, spans, batch, bound)
    except TimeoutError:
        raise ReplicaGone(d.model) from None


class ReplicaGone(Exception):
    """A batch's replica died and the batch sent again found no live one in time."""

    def __init__(self, model: str) -> None:
        super().__init__(f"{model}: its replica went away and no other answered in time")


class NobodyWaits(Exception):
    """A batch's replica died after every request in it had its answer (deadline, client gone):
    nothing to send again, and no model failure (the retry would have found a live replica)."""


def _model_failed(error: Exception) -> bool:
    """Whether a failed batch counts against the model's breaker and in-flight limit."""
    client_error = isinstance(error, ServeAppError) and error.status_code < 500
    return not client_error and not isinstance(error, NobodyWaits)


def _to_retry(model: str, error: Exception, timeout_s: float, replica_died: bool) -> Exception:
    """A batch timeout, or a replica that died under both tries (Serve is replacing it): a 503 to retry."""
    if isinstance(error, TimeoutError):
        return Unavailable(f"{model}: batch timed out after {timeout_s:g} s", retry_after_s=1.0)
    if replica_died or isinstance(error, ReplicaGone):
        return Unavailable(f"{model}: its replica went away; retry shortly", retry_after_s=1.0)
    return error


def _fail(batch: list[Ticket], error: Exception) -> None:
    for ticket in batch:
        if not ticket.result.done():
            ticket.result.set_exception(error)


def _answer(batch: list[Ticket], reply: BatchReply, rtt: float, answered: float, stats: DispatchStats) -> None:
    """Each request its own result (an error for its row alone, or its answer), unless already answered."""
    for ticket, result in zip(batch, reply.results, strict=True):
        ticket.model_s, ticket.replica_s = rtt, reply.wait_s + reply.exec_s
        if ticket.result.done():
            continue
        if isinstance(result, BaseException):
            ticket.result.set_exception(result)
        else:
            ticket.result.set_result(result)
            stats.latency_s.append((ticket.priority.name.lower(), answered - ticket.enqueued))


class BatchSpans:
    """The traced requests of one batch: each gets its time in this queue and the batch's round
    trip as spans under its own trace; the replica's spans go under the round trip's."""

    def __init__(self, model: str, lane: str, batch: list[Ticket], sent: float) -> None:
        self.batch = batch
        self.requests = len(batch)
        self.items = sum(t.items for t in batch)
        attributes = {"serve_app.model": model, "serve_app.lane": lane}
        self.round_trips: dict[int, tracing.OpenSpan | None] = {}  # by id() of the ticket
        for t in batch:
            if t.trace is None:
                self.round_trips[id(t)] = None
                continue
            queue_attrs = {**attributes, "serve_app.priority": t.priority.name.lower(), "serve_app.items": t.items}
            tracing.record("router.queue", t.trace, t.enqueued, sent, queue_attrs)
            batch_attrs = {**attributes, "serve_app.batch.requests": self.requests, "serve_app.batch.items": self.items}
            self.round_trips[id(t)] = tracing.OpenSpan.start("model.batch", t.trace, sent, batch_attrs)

    def traceparents(self, tickets: list[Ticket]) -> list[str | None]:
        return [s.traceparent if (s := self.round_trips[id(t)]) is not None else None for t in tickets]

    def end(
        self, at: float, reply: BatchReply | None = None, error: BaseException | None = None, sent: list[Ticket] | None = None
    ) -> None:
        """`sent`: the tickets `reply` answers, in its order (the batch, or the part of it sent again)."""
        answered = sent if sent is not None else self.batch
        results = {id(t): r for t, r in zip(answered, reply.results, strict=True)} if reply else {}
        for ticket in self.batch:
            if (span := self.round_trips[id(ticket)]) is None:
                continue
            if reply is not None and id(ticket) in results:
                span.set("serve_app.replica.wait_ms", reply.wait_s * 1e3)
                span.set("serve_app.replica.exec_ms", reply.exec_s * 1e3)
                result = results[id(ticket)]
                span.end(at, result if isinstance(result, BaseException) else None)
            elif reply is not None:  # not sent again: answered meanwhile (its deadline, or its client left)
                span.end(at, _settled_error(ticket))
            else:
                span.end(at, error)


def _settled_error(ticket: Ticket) -> BaseException:
    if ticket.result.cancelled():
        return asyncio.CancelledError("the client left")
    return ticket.result.exception() or asyncio.CancelledError("answered before the retry")
