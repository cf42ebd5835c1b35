"""Priority protection inside one router: lower classes yield the router's own time to higher
ones that are arriving.

The router's overload target (serve_app/scheduling/overload.py) refuses low priority once the
router is far behind. Well before that, the lower classes already cost a high-priority request
its latency: every step of a request (its body, its model call, its answer) waits its turn on the
router's one event loop behind every other request's steps, and a router that keeps up with a
flood still runs each loop turn long. No queue of ours can reorder those turns. What can be
bounded is how many lower-class requests are in the router at once.

So while a higher class has arrived within `window_s`, each lower class may have at most its
limit of requests in flight here; the rest are refused from their headers, before their bodies
are read. The limit follows the loop's lateness the way TCP's window and adaptive concurrency
limiters follow delay (AIMD): halved while the loop runs later than the target (low) or twice the
target (normal), one more after each adjustment period on time while it binds. With no higher
class arriving there is nothing to protect, and nothing is capped: a router that serves one class
runs at its full capacity, under the overload target alone.

No Ray and no event loop here: the clock is injected, and the router feeds it arrivals,
departures and lateness samples.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from serve_app.contract import Priority

GUARDED = (Priority.LOW, Priority.NORMAL)


class ClassProtection:
    """Per lower class: its requests in flight, their limit, and the refusals."""

    def __init__(
        self,
        target_s: float,
        window_s: float = 1.0,
        start: int = 8,
        ceiling: int = 4096,
        adjust_every_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if target_s <= 0:
            raise ValueError(f"the protection's delay target must be positive, got {target_s}")
        assert 1 <= start <= ceiling and window_s > 0 and adjust_every_s > 0
        self.target_s, self.window_s, self.ceiling = target_s, window_s, ceiling
        self.adjust_every_s = adjust_every_s
        self.clock = clock
        self.limit: dict[Priority, float] = {p: float(start) for p in GUARDED}
        self.in_flight: Counter[Priority] = Counter()
        self.refused: Counter[str] = Counter()  # by priority name, for /router/status
        self._last_seen: dict[Priority, float] = {}
        self._adjusted = clock()

    def guarding(self, priority: Priority) -> bool:
        """Whether a class above this one has arrived within the window."""
        now = self.clock()
        return any(p.value < priority.value and now - seen <= self.window_s for p, seen in self._last_seen.items())

    def enter(self, priority: Priority) -> bool:
        """A request of this class arrives: True when it may go on (it is then in flight until
        `leave`), False when it is refused (counted)."""
        self._last_seen[priority] = self.clock()
        if priority not in GUARDED:
            return True
        if self.guarding(priority) and self.in_flight[priority] >= int(self.limit[priority]):
            self.refused[priority.name.lower()] += 1
            return False
        self.in_flight[priority] += 1
        return True

    def leave(self, priority: Priority) -> None:
        """A request that `enter` let go on was answered (or failed, or was cancelled)."""
        if priority in GUARDED:
            self.in_flight[priority] -= 1

    def follow(self, lag_s: float) -> None:
        """A lateness sample of the router's loop; limits change at most once per period, and only
        a guarded class's: a limit moved while nothing is capped would describe no load at all. It
        grows only while it binds (as TCP validates its window), so a quiet spell does not leave
        it too high to protect anything when a higher class comes back."""
        now = self.clock()
        if now - self._adjusted < self.adjust_every_s:
            return
        self._adjusted = now
        for p in GUARDED:
            if not self.guarding(p):
                continue
            threshold = self.target_s if p == Priority.LOW else 2 * self.target_s
            if lag_s > threshold:
                self.limit[p] = self.limit[p] / 2  # under one: none at all, until the loop is on time
            elif self.in_flight[p] >= int(self.limit[p]):
                self.limit[p] = min(float(self.ceiling), self.limit[p] + 1)

    def status(self) -> dict[str, object]:
        """For /router/status: the limits, what is in flight, and the refusals so far."""
        return {
            "limit": {p.name.lower(): int(self.limit[p]) for p in GUARDED},
            "in_flight": {p.name.lower(): self.in_flight[p] for p in GUARDED},
            "refused": dict(self.refused),
        }
