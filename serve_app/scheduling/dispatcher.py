"""Per-model dispatcher: admission, the priority queue, and batch release under a learned limit.

The router holds every request here and releases work to the model only
while it has a free slot, as one batch (one handle call) at a time. Batches
therefore form in the router, where priority and deadlines are known, and
never queue in Ray's FIFO queues behind a flood of low-priority work. One
handle call per batch instead of per request also halves the per-request CPU
of the router->model hop (measured in benchmarks/results/profile/).

No Ray here: `send` is any coroutine that runs a batch, so the policy is
tested with a fake model.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from serve_app.errors import DeadlineExceeded, Overloaded, ServeAppError, Unavailable
from serve_app.scheduling.breaker import CircuitBreaker
from serve_app.scheduling.estimate import LatencyEstimator
from serve_app.scheduling.limit import AdaptiveLimit
from serve_app.scheduling.queue import Priority, QueueFull, QueuePolicy, RequestQueue, Ticket


@dataclass
class BatchReply:
    """What a replica returns for one batch: a result or an exception per payload, and timings."""

    results: list[Any]
    wait_s: float  # queued at the replica before the batch started
    exec_s: float  # running the batch
    max_batch_size: int | None = None  # the replica's live batching config, so user_config reaches the router
    batch_wait_timeout_s: float | None = None


# (payloads, rows still queued in this router for the model) -> reply
SendBatch = Callable[[list[Any], int], Awaitable[BatchReply]]


@dataclass
class DispatchSettings:
    policy: QueuePolicy = "priority"
    max_queue_items: int = 1024
    max_queue_delay_s: float = 2.0
    max_batch_size: int = 16
    batch_wait_timeout_s: float = 0.004
    batch_timeout_s: float = 30.0  # a batch taking longer counts as a model failure
    breaker_failures: int = 5  # failed batches in a row that open the circuit
    breaker_open_s: float = 5.0


@dataclass
class DispatchStats:
    """Monotonic counters; the metrics exporter reads differences."""

    admitted: Counter[str] = field(default_factory=Counter)  # by priority name
    shed: Counter[str] = field(default_factory=Counter)  # by reason
    completed_items: int = 0
    batches: int = 0
    queue_wait_s: list[float] = field(default_factory=list)  # drained by the exporter


class Dispatcher:
    """Admits requests for one model, queues them, and sends them in batches."""

    def __init__(
        self,
        model: str,
        send: SendBatch,
        settings: DispatchSettings | None = None,
        limit: AdaptiveLimit | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.send = send
        self.settings = settings or DispatchSettings()
        self.queue = RequestQueue(self.settings.policy, self.settings.max_queue_items)
        self.limit = limit or AdaptiveLimit()
        self.estimator = LatencyEstimator()
        self.breaker = CircuitBreaker(self.settings.breaker_failures, self.settings.breaker_open_s, clock)
        self.clock = clock
        self.inflight = 0
        self.inflight_items = 0
        self.stats = DispatchStats()
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def prioritized(self) -> bool:
        return self.settings.policy == "priority"

    # -- admission -------------------------------------------------------------

    def predicted_s(self, items: int, priority: Priority) -> float:
        s = self.settings
        ahead = self.queue.items_ahead(priority)
        return self.estimator.completion_s(ahead, items, s.max_batch_size, self.limit.slots, self.inflight, self.inflight_items)

    def _retry_after(self) -> float:
        s = self.settings
        return max(1.0, self.estimator.drain_s(self.queue.items, s.max_batch_size, self.limit.slots))

    def _refuse(self, reason: str, message: str) -> Overloaded:
        self.stats.shed[reason] += 1
        return Overloaded(f"{self.model}: {message}", retry_after_s=self._retry_after())

    def admit(self, payload: Any, items: int, priority: Priority, deadline: float | None) -> Ticket:
        """Queue a request or raise Overloaded; never spends model time on a refused one."""
        now = self.clock()
        if not self.breaker.allow():
            self.stats.shed["breaker_open"] += 1
            raise Unavailable(
                f"{self.model}: circuit open after repeated failures", retry_after_s=max(1.0, self.breaker.retry_after_s())
            )
        if self.prioritized:
            predicted = self.predicted_s(items, priority)
            if deadline is not None and now + predicted > deadline:
                raise self._refuse("deadline", f"cannot meet the deadline (about {predicted * 1000:.0f} ms of work ahead)")
            if predicted > self.settings.max_queue_delay_s:
                raise self._refuse("queue_delay", f"overloaded (about {predicted:.1f} s of work queued)")
        ticket = Ticket(payload, items, priority, deadline if self.prioritized else None, now)
        try:
            evicted = self.queue.push(ticket)
        except QueueFull as e:
            raise self._refuse("queue_full", f"overloaded ({e})") from None
        ticket.result = asyncio.get_running_loop().create_future()
        for victim in evicted:
            self.stats.shed["evicted"] += 1
            victim.result.set_exception(
                Overloaded(f"{self.model}: shed for higher-priority work", retry_after_s=self._retry_after())
            )
        self.stats.admitted[priority.name.lower()] += 1
        self._dispatch()
        return ticket

    async def submit(self, payload: Any, items: int, priority: Priority = Priority.NORMAL, deadline: float | None = None) -> Any:
        """Admit, wait for the batch, return this request's result (or raise its error)."""
        ticket = self.admit(payload, items, priority, deadline)
        try:
            return await ticket.result
        except asyncio.CancelledError:
            # The client went away: free its place so it costs no model time.
            self.queue.cancel(ticket)
            raise

    def snapshot(self) -> dict[str, Any]:
        """What an operator wants to see about this queue right now (the router's /router/status)."""
        s = self.settings
        return {
            "policy": s.policy,
            "queued_items": {p.name.lower(): n for p, n in self.queue.items_by_priority.items()},
            "inflight_batches": self.inflight,
            "inflight_limit": round(self.limit.value, 2),
            "replica_queue_estimate": round(self.limit.queue_estimate, 3),
            "breaker": self.breaker.state.name.lower(),
            "max_batch_size": s.max_batch_size,
            "batch_ms": {
                "one": round(self.estimator.batch_s(1) * 1e3, 3),
                "full": round(self.estimator.batch_s(s.max_batch_size) * 1e3, 3),
            },
            "admitted": dict(self.stats.admitted),
            "shed": dict(self.stats.shed),
            "completed_items": self.stats.completed_items,
            "batches": self.stats.batches,
        }

    # -- release -----------------------------------------------------------------

    def _dispatch(self) -> None:
        """Send batches while slots are free. Runs on every admission and completion."""
        s = self.settings
        while self.queue.items and self.inflight < self.limit.slots:
            now = self.clock()
            if self.inflight and self.queue.items < s.max_batch_size:
                # A batch is running anyway: let this one fill for up to the batch timeout.
                waited = self.queue.oldest_wait(now)
                if waited < s.batch_wait_timeout_s:
                    self._arm_timer(s.batch_wait_timeout_s - waited)
                    return
            batch, expired = self.queue.pop_batch(s.max_batch_size, now)
            for ticket in expired:
                self.stats.shed["expired"] += 1
                ticket.result.set_exception(DeadlineExceeded(f"{self.model}: deadline passed while queued"))
            if not batch:
                continue
            self.inflight += 1
            self.inflight_items += sum(t.items for t in batch)
            task = asyncio.get_running_loop().create_task(self._run(batch, self.inflight, now))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _arm_timer(self, delay_s: float) -> None:
        if self._timer is None:

            def fire() -> None:
                self._timer = None
                self._dispatch()

            self._timer = asyncio.get_running_loop().call_later(delay_s, fire)

    async def _run(self, batch: list[Ticket], inflight: int, sent: float) -> None:
        for ticket in batch:
            self.stats.queue_wait_s.append(sent - ticket.enqueued)
        try:
            reply = await asyncio.wait_for(self.send([t.payload for t in batch], self.queue.items), self.settings.batch_timeout_s)
        except Exception as e:  # the whole batch failed: every request gets the error
            if isinstance(e, TimeoutError):
                e = Unavailable(f"{self.model}: batch timed out after {self.settings.batch_timeout_s:g} s")
            if not (isinstance(e, ServeAppError) and e.status_code < 500):  # a client's bad input is no model failure
                self.limit.on_failure()
                self.breaker.on_failure()
            for ticket in batch:
                if not ticket.result.done():
                    ticket.result.set_exception(e)
        else:
            self.breaker.on_success()
            rtt = self.clock() - sent
            items = sum(t.items for t in batch)
            self.limit.on_batch(reply.wait_s, reply.exec_s, inflight)
            self.estimator.observe(items, rtt, reply.wait_s)
            self._adopt(reply)
            self.stats.completed_items += items
            self.stats.batches += 1
            for ticket, result in zip(batch, reply.results, strict=True):
                if ticket.result.done():
                    continue
                if isinstance(result, BaseException):
                    ticket.result.set_exception(result)
                else:
                    ticket.result.set_result(result)
        finally:
            self.inflight -= 1
            self.inflight_items -= sum(t.items for t in batch)
            self._dispatch()

    def _adopt(self, reply: BatchReply) -> None:
        """Follow the replica's live batching config (`user_config` is set on the model)."""
        if reply.max_batch_size is not None:
            self.settings.max_batch_size = reply.max_batch_size
        if reply.batch_wait_timeout_s is not None:
            self.settings.batch_wait_timeout_s = reply.batch_wait_timeout_s
