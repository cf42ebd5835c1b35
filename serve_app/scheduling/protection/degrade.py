"""Degrading before refusing: which requests of a tiered route its light tier answers alone.

A route's heavy tier is where overload shows first: escalations are a minority of its items, but
each costs many light answers. When the heavy tier's queue grows past its class budgets, its
admission refuses low, then normal priority (`DispatchSettings.wait_budget_s`), and every refused
escalation would be a 503 for a request whose light answer is already in hand. `Degrading` acts
one step earlier: while the heavy queue stands over a lower target than low's budget, a share of each degradable class skips
the heavy tier and gets the light answer, marked degraded. Skipped escalations take load off the
heavy tier, so its queue falls back under the refusal target and refusals mostly never start.

The level and the class order are `ClassShedding`'s (CoDel's standing delay; low first, normal
only once all of low degrades, high never by level). Which classes may degrade is the route's
choice: a class left out always goes to the heavy tier and takes its refusal when it comes. The
fallback after the heavy tier refused (`after_refusal`) follows the same list, high included when
listed: a light answer then beats a 503 for any class the route lets degrade.

No Ray and no event loop here: the heavy queue's samples are fed by the cascade at each decision,
and the clock and the random draw are injected.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterable

from serve_app.contract import Priority
from serve_app.scheduling.protection.overload import ClassShedding


class Degrading:
    """One route's degradation policy.

    `priorities`: the classes that may be answered by the light tier alone. `target_s`: the heavy
    queue's standing delay (its oldest request's age) over which degrading starts; below the
    heavy tier's own refusal target, so that degrading comes first."""

    def __init__(
        self,
        priorities: Iterable[Priority],
        target_s: float,
        clock: Callable[[], float] = time.monotonic,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.priorities = frozenset(priorities)
        # Judged over an interval no shorter than the target, as the heavy queue's own shedding is.
        self.level = ClassShedding(target_s, interval_s=max(0.1, target_s), clock=clock, draw=draw)
        self.degraded: Counter[str] = Counter()  # requests by priority name, for /router/status

    @property
    def enabled(self) -> bool:
        return bool(self.priorities)

    def follow(self, heavy_standing_s: float) -> None:
        """A sample of the heavy tier's queue: its oldest request's age now (0 when empty)."""
        if self.enabled:
            self.level.observe(heavy_standing_s)

    def before_heavy(self, priority: Priority) -> bool:
        """Whether this request's escalated items skip the heavy tier now (counted when they do)."""
        if priority not in self.priorities or not self.level.active:
            return False
        if self.level.refuses(priority):  # drawn at the level's share of this class
            self.degraded[priority.name.lower()] += 1
            return True
        return False

    def after_refusal(self, priority: Priority) -> bool:
        """Whether the light answer stands in for the heavy tier's refusal (overloaded, or too slow
        for the deadline) of this request."""
        if priority in self.priorities:
            self.degraded[priority.name.lower()] += 1
            return True
        return False

    def share(self, priority: Priority) -> float:
        """The share of this class degraded before the heavy tier at the current level."""
        return self.level.share(priority) if priority in self.priorities else 0.0

    def status(self) -> dict[str, object]:
        return {
            "priorities": sorted(p.name.lower() for p in self.priorities),
            "level": round(self.level.level, 3),
            "standing_delay_ms": round(self.level.standing_s * 1e3, 2),
            "target_ms": round(self.level.target_s * 1e3, 2),
            "share": {p.name.lower(): round(self.share(p), 3) for p in (Priority.NORMAL, Priority.LOW)},
            "degraded": dict(self.degraded),
        }
