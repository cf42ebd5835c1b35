"""The router's own overload: its queueing delay, and who is refused when it stands.

Admission protects the models: it refuses what their queues cannot serve in time.
When the router itself is the bottleneck (its one event loop busy with parsing,
routing and answering), requests wait in front of it, in the proxy and the
socket buffers, where no queue of ours sees them, first come first served. The
router's event loop then runs late, and how late its timers fire is the delay a
new request meets before any handler runs (the sojourn time CoDel and
Breakwater control).

`ClassShedding` refuses only while that delay *stands*: as CoDel does, it looks at
the smallest lateness seen over an interval, so a burst or one long pause (a
garbage collection, a slow handler) refuses nothing, and a loop that keeps up
(below capacity) is never late for a whole interval. While it stands above the
target, a shed level rises, in proportion to how far over it is; while it is
under, the level falls back. The level orders the classes as Google SRE's
criticality-based shedding does: from 0 to 1 it is the share of low-priority
requests refused, from 1 to 2 all of low plus that share of normal; high priority
is never refused here. Refusing a share rather than a whole class keeps the router
at its capacity: it sheds what the bottleneck cannot take, not everything of a
class the moment a threshold is crossed.

A late loop is not always a queue, though: on a machine whose cores the router shares, its
loop runs late whenever others take the CPU, or after a pause, while it still reads every
request as it comes. So before the level rises, `ClassShedding` asks a second witness when it
has one (`FrontQueue`): how long the requests that reached the router's sockets and are not
read yet will wait, their count over the rate the router takes requests in (Little's law). A
loop that is late with nobody waiting refuses nobody.

No Ray and no event loop here: lateness samples are fed by whoever ticks (the
router's background loops), and the clock, the random draw and the socket count are injected.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable

from serve_app.contract import Priority

# The shed level's range: low's share in [0, 1], then normal's on top of all of low.
SHED_CEILING = 2.0


class LoopLag:
    """How late the event loop runs, smoothed: a moving average of lateness samples, for
    /router/status and the router's autoscaling signal."""

    def __init__(self, weight: float = 0.2) -> None:
        assert 0.0 < weight <= 1.0, f"weight must be in (0, 1], got {weight}"
        self.weight = weight
        self.lag_s = 0.0

    def observe(self, late_s: float) -> None:
        self.lag_s += self.weight * (max(0.0, late_s) - self.lag_s)


class FrontQueue:
    """The wait in front of the router: requests in its sockets it has not read (`unread`, None
    where that cannot be read), over the rate it has taken requests in since the last look."""

    def __init__(self, unread: Callable[[], int | None], clock: Callable[[], float] = time.monotonic) -> None:
        self.unread, self.clock = unread, clock
        self.arrived = 0  # requests the router has taken in, counted by its gate
        self.waiting = 0  # unread requests at the last look
        self._then, self._arrived_then = clock(), 0

    def wait_s(self) -> float | None:
        """The estimated wait now; None where the sockets cannot be read. Requests waiting while
        none was taken in since the last look wait without end: the router is stuck."""
        waiting = self.unread()
        now, arrived = self.clock(), self.arrived
        came, elapsed = arrived - self._arrived_then, now - self._then
        self._then, self._arrived_then = now, arrived
        if waiting is None:
            return None
        self.waiting = waiting
        if waiting == 0:
            return 0.0
        return waiting * elapsed / came if came > 0 and elapsed > 0 else math.inf


class ClassShedding:
    """Which share of each class the router refuses, from the standing delay of its own loop.

    `target_s`: the standing delay the source may keep. `interval_s`: the window whose smallest
    sample is the standing delay; samples arrive every few milliseconds, so one window holds
    several. `rise`: how far the level moves up per second per target's worth of delay over the
    target (capped at four targets' worth, so one very late window does not shed everything).
    `fall`: how far it moves down per second spent under the target. Rates per second, not per
    interval, so that a longer window (a slow model's queue) measures more calmly without
    reacting more slowly. `front`: when given, a window over the target raises the level only
    while the requests waiting in front of the source would wait longer than the target too."""

    def __init__(
        self,
        target_s: float,
        interval_s: float = 0.1,
        rise: float = 1.0,
        fall: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        draw: Callable[[], float] = random.random,
        front: FrontQueue | None = None,
    ) -> None:
        if target_s <= 0:
            raise ValueError(f"the router's delay target must be positive, got {target_s}")
        if interval_s <= 0 or rise <= 0 or fall <= 0:
            raise ValueError(f"interval, rise and fall must be positive, got {interval_s}, {rise}, {fall}")
        self.target_s, self.interval_s, self.rise, self.fall = target_s, interval_s, rise, fall
        self.clock, self.draw, self.front = clock, draw, front
        self.level = 0.0
        self.front_wait_s: float | None = None  # the front's wait at the last window over the target
        self.standing_s = 0.0  # the last interval's standing delay
        self.refused: Counter[str] = Counter()  # by priority name, for /router/status
        self._window_min: float | None = None
        self._window_start = clock()

    @property
    def active(self) -> bool:
        """Whether any class is being refused now (the cheap test on the request path)."""
        return self.level > 0.0

    def observe(self, late_s: float) -> None:
        """One lateness sample of the loop; at the end of each interval the level follows the
        interval's standing delay."""
        late_s = max(0.0, late_s)
        self._window_min = late_s if self._window_min is None else min(self._window_min, late_s)
        now = self.clock()
        elapsed = now - self._window_start
        if elapsed < self.interval_s * (1 - 1e-9):  # a clock's rounding is not a window short
            return
        self.standing_s, self._window_min, self._window_start = self._window_min, None, now
        if self.standing_s > self.target_s and self._someone_waits():
            over = min(4.0, self.standing_s / self.target_s - 1.0)
            # One window's worth of rise, however long ago the last sample was.
            self.level = min(SHED_CEILING, self.level + self.rise * self.interval_s * max(over, 0.25))
        else:  # a source that samples only when busy (a queue) says nothing while idle: idle is on time
            self.level = max(0.0, self.level - self.fall * elapsed)

    def _someone_waits(self) -> bool:
        """Whether requests wait in front longer than the target; true where nobody can tell."""
        if self.front is None:
            return True
        self.front_wait_s = self.front.wait_s()
        return self.front_wait_s is None or self.front_wait_s > self.target_s

    def share(self, priority: Priority) -> float:
        """The share of this class refused at the current level."""
        if priority == Priority.LOW:
            return min(1.0, self.level)
        if priority == Priority.NORMAL:
            return max(0.0, self.level - 1.0)
        return 0.0

    def refuses(self, priority: Priority) -> bool:
        """Whether to refuse this request of this class now; counts the refusals."""
        share = self.share(priority)
        if share <= 0.0 or (share < 1.0 and self.draw() >= share):
            return False
        self.refused[priority.name.lower()] += 1
        return True

    def status(self) -> dict[str, object]:
        """For /router/status: the level, each class's refused share, the refusals so far."""
        return {
            "level": round(self.level, 3),
            "standing_delay_ms": round(self.standing_s * 1e3, 2),
            "target_ms": round(self.target_s * 1e3, 2),
            **({} if self.front is None else {"front": self._front_status(self.front)}),
            "refused_share": {p.name.lower(): round(self.share(p), 3) for p in (Priority.NORMAL, Priority.LOW)},
            "refused": dict(self.refused),
        }

    def _front_status(self, front: FrontQueue) -> dict[str, object]:
        wait = self.front_wait_s
        return {"wait_ms": None if wait is None or math.isinf(wait) else round(wait * 1e3, 2), "waiting": front.waiting}


class CpuMeter:
    """Cores a process used between two samples: what a router reports to its autoscaler.

    A router's work is one event loop's (one core at most, under the GIL) plus its helper
    threads; its CPU is the load that more router replicas divide. Clocks are injected, so
    the meter is exact in tests."""

    def __init__(self, cpu_clock: Callable[[], float] = time.process_time, clock: Callable[[], float] = time.monotonic) -> None:
        self.cpu_clock = cpu_clock
        self.clock = clock
        self._last: tuple[float, float] | None = None

    def sample(self) -> float:
        """Cores used since the last sample (0 when no time has passed). The first sample only
        sets the baseline: before it lies the process's start-up, which is no load."""
        now, cpu = self.clock(), self.cpu_clock()
        last, self._last = self._last, (now, cpu)
        if last is None:
            return 0.0
        then, cpu_then = last
        return max(0.0, cpu - cpu_then) / (now - then) if now > then else 0.0
