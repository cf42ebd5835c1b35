"""Per-model request queues, one class per scheduling policy, chosen by `make_queue`.

Both are bounded in items (tensor rows), not requests, because items are what
cost model time and memory.
- `PriorityQueue`: priority classes, earliest deadline first within a class. When
  it is full, a request of a higher class evicts the worst queued one (lowest
  class, latest deadline, newest); one no better than the worst is refused.
- `FifoQueue`: arrival order, no eviction: the baseline the benchmarks compare with.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from serve_app.contract import Priority
from serve_app.errors import InvalidInput

QueuePolicy = Literal["priority", "fifo"]


@dataclass(eq=False)
class Ticket:
    """One request's place in a queue. `items` rows of `payload` travel together."""

    payload: Any
    items: int
    priority: Priority
    deadline: float | None  # monotonic seconds; None = no deadline
    enqueued: float
    seq: int = 0
    done: bool = False  # dispatched, shed or cancelled: lazily dropped from the heap
    result: Any = field(default=None, repr=False)  # the dispatcher's future
    queued_s: float = 0.0  # set when its batch is sent: time waiting in this queue
    model_s: float = 0.0  # set when its batch returns: the round trip to the model
    replica_s: float = 0.0  # of which the replica's own time: its queue and the run (the rest is transport)
    trace: Any = field(default=None, repr=False)  # the request's trace context (OpenTelemetry), None untraced


class QueueFull(Exception):
    """The queue has no room for this request, and it may not evict anything."""


class RequestQueue:
    """A bounded heap of tickets; subclasses say the order, who may evict whom, and what
    runs ahead of a new request."""

    policy: ClassVar[QueuePolicy]
    # Whether the dispatcher admits by class and deadline (and so may shed) and keeps an urgent lane.
    prioritized: ClassVar[bool]

    def __init__(self, max_items: int = 1024) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        self.max_items = max_items
        self._heap: list[tuple[tuple[float, ...], Ticket]] = []
        # Each class's arrival order, done ones dropped lazily from the left.
        self._arrivals: dict[Priority, deque[Ticket]] = {p: deque() for p in Priority}
        self._seq = itertools.count()
        self.items = 0
        self.tickets = 0
        self.items_by_priority = {p: 0 for p in Priority}

    def __len__(self) -> int:
        return self.tickets

    def push(self, ticket: Ticket) -> list[Ticket]:
        """Queue `ticket`; returns the tickets evicted to make room for it.

        Raises QueueFull when the ticket does not fit and outranks nothing.
        """
        if ticket.items > self.max_items:  # it could never be queued: the caller's 400, not a 503 to retry
            raise InvalidInput(f"{ticket.items} items in one request; the model's queue holds at most {self.max_items}")
        evicted: list[Ticket] = []
        if self.items + ticket.items > self.max_items:
            victims = self._victims(ticket)
            if victims is None:
                raise QueueFull("queue full of work at or above this priority")
            for v in victims:
                self._discard(v)
            self._compact()
            evicted = victims
        ticket.seq = next(self._seq)
        heapq.heappush(self._heap, (self.sort_key(ticket), ticket))
        arrivals = self._arrivals[ticket.priority]
        arrivals.append(ticket)
        if len(arrivals) > 2 * self.tickets + 64:  # an old ticket at the front holds the taken ones behind it
            self._arrivals[ticket.priority] = deque(t for t in arrivals if not t.done)
        self._count(ticket, +1)
        return evicted

    def sort_key(self, ticket: Ticket) -> tuple[float, ...]:
        """The heap order: smallest first."""
        raise NotImplementedError

    def _victims(self, ticket: Ticket) -> list[Ticket] | None:
        """Queued tickets to evict so that `ticket` fits, or None to refuse it."""
        raise NotImplementedError

    def _joins(self, ticket: Ticket, batch: list[Ticket]) -> bool:
        """Whether `ticket` may join a batch that `batch[0]` leads (room permitting)."""
        raise NotImplementedError

    def items_ahead(self, priority: Priority) -> int:
        """Rows that would run before a new request of `priority` (an upper bound)."""
        raise NotImplementedError

    def pop_batch(self, max_items: int, now: float) -> tuple[list[Ticket], list[Ticket]]:
        """Up to `max_items` rows of the best tickets, and those whose deadline passed.

        A ticket is never split: a request's rows run in one model batch. The
        first ticket is taken even when it alone exceeds `max_items`; the replica
        splits it.
        """
        batch: list[Ticket] = []
        expired: list[Ticket] = []
        size = 0
        while self._heap:
            ticket = self._heap[0][1]
            if ticket.done:
                heapq.heappop(self._heap)
                continue
            if ticket.deadline is not None and ticket.deadline <= now:
                heapq.heappop(self._heap)
                self._discard(ticket)
                expired.append(ticket)
                continue
            if batch and size + ticket.items > max_items:
                break
            if batch and not self._joins(ticket, batch):
                break
            heapq.heappop(self._heap)
            self._discard(ticket)
            batch.append(ticket)
            size += ticket.items
            if size >= max_items:
                break
        return batch, expired

    def cancel(self, ticket: Ticket) -> None:
        """Forget a ticket whose caller went away (it stays in the heap until popped)."""
        if not ticket.done:
            self._discard(ticket)
            self._compact()

    def queued(self) -> list[Ticket]:
        """The tickets still queued, in no particular order."""
        return [t for _, t in self._heap if not t.done]

    def oldest_wait(self, now: float, priority: Priority | None = None) -> float:
        """Seconds the oldest queued ticket (of `priority`, or of any class) has waited; 0 when
        none is queued. Amortized O(1): what is taken, shed or cancelled leaves the arrival order
        when it reaches the front."""
        oldest = now
        for p in Priority if priority is None else (priority,):
            arrivals = self._arrivals[p]
            while arrivals and arrivals[0].done:
                arrivals.popleft()
            if arrivals:
                oldest = min(oldest, arrivals[0].enqueued)
        return now - oldest

    def _discard(self, ticket: Ticket) -> None:
        ticket.done = True
        self._count(ticket, -1)

    def _compact(self) -> None:
        # Evicted and cancelled tickets stay in the heap until popped, and the worst-ranked
        # ones never reach the top under sustained load: drop them in bulk once they
        # outnumber the live ones, so the heap stays bounded too.
        if len(self._heap) > 2 * self.tickets + 64:
            self._heap = [e for e in self._heap if not e[1].done]
            heapq.heapify(self._heap)

    def _count(self, ticket: Ticket, sign: int) -> None:
        self.tickets += sign
        self.items += sign * ticket.items
        self.items_by_priority[ticket.priority] += sign * ticket.items


class PriorityQueue(RequestQueue):
    """Priority classes first, then earliest deadline, then arrival."""

    policy = "priority"
    prioritized = True

    def sort_key(self, ticket: Ticket) -> tuple[float, ...]:
        return (int(ticket.priority), ticket.deadline if ticket.deadline is not None else math.inf, ticket.seq)

    def _victims(self, ticket: Ticket) -> list[Ticket] | None:
        """The worst-ranked tickets, strictly below `ticket`'s class, that free enough room."""
        need = self.items + ticket.items - self.max_items
        candidates = sorted(
            (t for _, t in self._heap if not t.done and t.priority > ticket.priority), key=self.sort_key, reverse=True
        )
        chosen, freed = [], 0
        for t in candidates:
            if freed >= need:
                break
            chosen.append(t)
            freed += t.items
        return chosen if freed >= need else None

    def _joins(self, ticket: Ticket, batch: list[Ticket]) -> bool:
        # Never fill a batch led by high priority with lower-class rows: that batch would run
        # longer, and the high-priority rows in it would wait for the others. A normal-led batch
        # takes low rows to fill up: a full batch costs less per row, and under overload that
        # is the goodput the lower classes get at all.
        return ticket.priority == batch[0].priority or batch[0].priority != Priority.HIGH

    def items_ahead(self, priority: Priority) -> int:
        return sum(n for p, n in self.items_by_priority.items() if p <= priority)


class FifoQueue(RequestQueue):
    """Arrival order for every class; a full queue refuses (the baseline)."""

    policy = "fifo"
    prioritized = False

    def sort_key(self, ticket: Ticket) -> tuple[float, ...]:
        return (ticket.seq,)

    def _victims(self, ticket: Ticket) -> list[Ticket] | None:
        return None

    def _joins(self, ticket: Ticket, batch: list[Ticket]) -> bool:
        return True

    def items_ahead(self, priority: Priority) -> int:
        return self.items


QUEUES: dict[QueuePolicy, type[RequestQueue]] = {"priority": PriorityQueue, "fifo": FifoQueue}


def make_queue(policy: QueuePolicy, max_items: int = 1024) -> RequestQueue:
    """The queue class of a scheduling policy (the config's `scheduling.policy`)."""
    return QUEUES[policy](max_items)
