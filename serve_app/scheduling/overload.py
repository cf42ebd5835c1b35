"""The router's own overload: its queueing delay, and who is refused when it grows.

Admission protects the models: it refuses what their queues cannot serve in time.
When the router itself is the bottleneck (its one event loop busy with parsing,
routing and answering), requests wait in front of it, in the proxy and the
socket buffers, where no queue of ours sees them, first come first served. The
router's event loop then runs late, and how late its timers fire is the delay a
new request meets before any handler runs (the sojourn time CoDel and
Breakwater control). Past a target, low-priority work is refused from its
headers, before its body is read; past twice the target, normal priority too;
high priority always goes on. Refusing is cheaper than serving, so the loop
catches up and the delay falls back under the target.

No Ray and no event loop here: `LoopLag` is fed lateness samples by whoever
ticks (the router's background loops), and the decisions are plain functions
of priority and delay.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from serve_app.contract import Priority


class LoopLag:
    """How late the event loop runs, sustained: a moving average of lateness samples. One long
    pause (a garbage collection, a slow handler) moves it a fraction of the way; only a loop
    that stays late, as a router past its capacity does, brings it to the target."""

    def __init__(self, weight: float = 0.2) -> None:
        assert 0.0 < weight <= 1.0, f"weight must be in (0, 1], got {weight}"
        self.weight = weight
        self.lag_s = 0.0

    def observe(self, late_s: float) -> None:
        self.lag_s += self.weight * (max(0.0, late_s) - self.lag_s)


class LagShedding:
    """Which priorities the router refuses at a given delay of its own."""

    def __init__(self, target_s: float) -> None:
        if target_s <= 0:
            raise ValueError(f"the router's delay target must be positive, got {target_s}")
        self.target_s = target_s
        self.refused: Counter[str] = Counter()  # by priority name, for /router/status

    def refuses(self, priority: Priority, lag_s: float) -> bool:
        """Whether to refuse a request of this class now; counts the refusals."""
        if priority == Priority.HIGH or lag_s <= (self.target_s if priority == Priority.LOW else 2 * self.target_s):
            return False
        self.refused[priority.name.lower()] += 1
        return True


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
