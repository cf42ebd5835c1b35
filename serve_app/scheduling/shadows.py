"""When a mirrored (shadow) call may run: only in the router's idle time.

A shadow doubles the model work of every request it mirrors, on the same cores and router as
the clients. Sent at once, it competes with the client requests that arrive while it runs; so
mirrors wait here, oldest first, and go out only while the router holds no client work (no
rows queued and no batch in flight to any deployment but the candidates), a few at a time (the
shadow's `batch`, one mirror by default): a client request that arrives while a shadow runs
then finds at most that much shadow work beside it, on cores it shares at the same CPU
priority. What waits is bounded: past `capacity` the oldest waiting mirror is dropped (counted
as `yielded`), and when nothing waits but `capacity` mirrors are already in flight, the new one
is not taken (`skipped`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class Offer(Generic[T]):
    """What taking a mirror cost: the mirror dropped to make room, or whether the new one was refused."""

    dropped: T | None = None
    refused: bool = False


class IdleRelease(Generic[T]):
    """Mirrors held until `busy()` says the router has no client work, then released `batch` at a time."""

    def __init__(self, busy: Callable[[], bool]) -> None:
        self.busy = busy
        self.waiting: deque[T] = deque()
        self.inflight = 0

    def offer(self, mirror: T, capacity: int) -> Offer[T]:
        """Hold `mirror`; waiting and in-flight mirrors together stay within `capacity`."""
        if self.inflight >= capacity:
            return Offer(refused=True)
        dropped = self.waiting.popleft() if len(self.waiting) + self.inflight >= capacity else None
        self.waiting.append(mirror)
        return Offer(dropped=dropped)

    def release(self, batch: int) -> list[T]:
        """The mirrors that may go now, counted in flight: up to `batch` of the oldest, when the
        router is idle and no mirror is still out."""
        if not self.waiting or self.inflight or self.busy():
            return []
        out = [self.waiting.popleft() for _ in range(min(batch, len(self.waiting)))]
        self.inflight += len(out)
        return out

    def done(self) -> None:
        """A released mirror finished, however it ended."""
        self.inflight -= 1
