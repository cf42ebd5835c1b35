"""Per-model request queue: priority classes, earliest deadline first within a class.

The queue is bounded in items (tensor rows), not requests, because items are
what cost model time and memory. When it is full, a request of a higher class
evicts the worst queued one (lowest class, latest deadline, newest); a request
that is no better than the worst queued one is refused instead.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Literal

QueuePolicy = Literal["priority", "fifo"]


class Priority(IntEnum):
    """Lower value is served first."""

    HIGH = 0
    NORMAL = 1
    LOW = 2

    @classmethod
    def parse(cls, value: str | int | None, default: Priority | None = None) -> Priority:
        """From a header (`high|normal|low`) or Triton's integer `parameters.priority`.

        Triton counts levels from 1 (highest); 0 means "the model's default".
        """
        if value is None or value == "" or value == 0:
            return default if default is not None else cls.NORMAL
        if isinstance(value, bool):
            raise ValueError(f"priority must be high, normal or low, got {value!r}")
        if isinstance(value, int):
            if value < 0:
                raise ValueError(f"priority must be >= 0, got {value}")
            return cls(min(value - 1, cls.LOW))
        try:
            return cls[value.strip().upper()]
        except KeyError:
            raise ValueError(f"priority must be high, normal or low, got {value!r}") from None


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

    def sort_key(self, policy: QueuePolicy) -> tuple[float, ...]:
        if policy == "fifo":
            return (self.seq,)
        return (int(self.priority), self.deadline if self.deadline is not None else math.inf, self.seq)


class QueueFull(Exception):
    """The queue has no room for this request, and it may not evict anything."""


class RequestQueue:
    """A bounded heap of tickets; `fifo` ignores priority and deadlines (the baseline)."""

    def __init__(self, policy: QueuePolicy = "priority", max_items: int = 1024) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        self.policy = policy
        self.max_items = max_items
        self._heap: list[tuple[tuple[float, ...], Ticket]] = []
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
        if ticket.items > self.max_items:
            raise QueueFull(f"{ticket.items} items exceed the queue's {self.max_items}")
        evicted: list[Ticket] = []
        if self.items + ticket.items > self.max_items:
            if self.policy == "fifo":
                raise QueueFull("queue full")
            victims = self._victims(ticket)
            if victims is None:
                raise QueueFull("queue full of work at or above this priority")
            for v in victims:
                self._discard(v)
            self._compact()
            evicted = victims
        ticket.seq = next(self._seq)
        heapq.heappush(self._heap, (ticket.sort_key(self.policy), ticket))
        self._count(ticket, +1)
        return evicted

    def _victims(self, ticket: Ticket) -> list[Ticket] | None:
        """The worst-ranked tickets, strictly below `ticket`, that free enough room."""
        need = self.items + ticket.items - self.max_items
        candidates = sorted(
            (t for _, t in self._heap if not t.done and t.priority > ticket.priority),
            key=lambda t: t.sort_key(self.policy),
            reverse=True,
        )
        chosen, freed = [], 0
        for t in candidates:
            if freed >= need:
                break
            chosen.append(t)
            freed += t.items
        return chosen if freed >= need else None

    def pop_batch(self, max_items: int, now: float) -> tuple[list[Ticket], list[Ticket]]:
        """Up to `max_items` rows of the best tickets, and those whose deadline passed.

        A ticket is never split: a request's rows run in one model batch. The
        first ticket is taken even when it alone exceeds `max_items`; the replica
        splits it. Under the priority policy a batch holds one class only.
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
            # Never fill a batch led by a higher class with lower-class rows: that batch would
            # run longer, and the high-priority rows in it would wait for the low ones.
            if batch and self.policy == "priority" and ticket.priority != batch[0].priority:
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

    def items_ahead(self, priority: Priority) -> int:
        """Rows that would run before a new request of `priority` (upper bound for EDF)."""
        if self.policy == "fifo":
            return self.items
        return sum(n for p, n in self.items_by_priority.items() if p <= priority)

    def oldest_wait(self, now: float) -> float:
        """Seconds the head of the queue has waited; 0 when empty."""
        live = [t.enqueued for _, t in self._heap if not t.done]
        return now - min(live) if live else 0.0

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
