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
(below capacity) is never late for a whole interval. An interval holds at least
two samples: the one sample taken after a pause longer than the interval is that
pause, and the next, on time, says the loop kept up; a loop that stays late is
late in both. While the delay stands above the target, a shed level rises, in
proportion to how far over it is; while it is under, the level falls back. The
level orders the classes as Google SRE's criticality-based shedding does: from 0
to 1 it is the share of low-priority requests refused, from 1 to 2 all of low
plus that share of normal; high priority is never refused here. Refusing a share
rather than a whole class keeps the router at its capacity: it sheds what the
bottleneck cannot take, not everything of a class the moment a threshold is
crossed.

No Ray and no event loop here: lateness samples are fed by whoever ticks (the
router's background loops), and the clock and the random draw are injected.
"""

from __future__ import annotations

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


class ClassShedding:
    """Which share of each class the router refuses, from the standing delay of its own loop.

    `target_s`: the standing delay the source may keep. `interval_s`: the window whose smallest
    sample is the standing delay; samples arrive every few milliseconds, so one window holds
    several, and it closes only once it holds two. `rise`: how far the level moves up per second
    per target's worth of delay over the target (capped at four targets' worth, so one very late
    window does not shed everything).
    `fall`: how far it moves down per second spent under the target. Rates per second, not per
    interval, so that a longer window (a slow model's queue) measures more calmly without
    reacting more slowly."""

    def __init__(
        self,
        target_s: float,
        interval_s: float = 0.1,
        rise: float = 1.0,
        fall: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        draw: Callable[[], float] = random.random,
    ) -> None:
        if target_s <= 0:
            raise ValueError(f"the router's delay target must be positive, got {target_s}")
        if interval_s <= 0 or rise <= 0 or fall <= 0:
            raise ValueError(f"interval, rise and fall must be positive, got {interval_s}, {rise}, {fall}")
        self.target_s, self.interval_s, self.rise, self.fall = target_s, interval_s, rise, fall
        self.clock, self.draw = clock, draw
        self.level = 0.0
        self.standing_s = 0.0  # the last interval's standing delay
        self.refused: Counter[str] = Counter()  # by priority name, for /router/status
        self._window_min: float | None = None
        self._window_samples = 0
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
        self._window_samples += 1
        now = self.clock()
        elapsed = now - self._window_start
        # A clock's rounding is not a window short; one sample is a pause, not a standing delay.
        if elapsed < self.interval_s * (1 - 1e-9) or self._window_samples < 2:
            return
        self.standing_s, self._window_min, self._window_start = self._window_min, None, now
        self._window_samples = 0
        if self.standing_s > self.target_s:
            over = min(4.0, self.standing_s / self.target_s - 1.0)
            # One window's worth of rise, however long ago the last sample was.
            self.level = min(SHED_CEILING, self.level + self.rise * self.interval_s * max(over, 0.25))
        else:  # a source that samples only when busy (a queue) says nothing while idle: idle is on time
            self.level = max(0.0, self.level - self.fall * elapsed)

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
            "refused_share": {p.name.lower(): round(self.share(p), 3) for p in (Priority.NORMAL, Priority.LOW)},
            "refused": dict(self.refused),
        }


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
