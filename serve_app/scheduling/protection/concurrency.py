"""How many requests one router holds at once, with a larger share for the more important classes.

A router past its capacity that accepts every connection holds thousands of requests, each a
task on its one event loop: every loop turn then runs long, its own health checks go
unanswered (the proxy in front takes it out), and requests that will be refused anyway wait
in front of the refusal. A ceiling on requests in flight keeps the loop short: past it a request
is refused from its headers, before its body is read, and the "no" comes at once.

The ceiling is partitioned by class as Envoy's and Netflix's concurrency limiters partition
theirs: low may fill the router up to `limit`, normal up to `normal_share` of it, high up to
`high_share`, so a flood of lower classes never takes the room a higher class needs, and high
is refused last.

No Ray and no event loop here: the router calls `enter` and `leave` around each request.
"""

from __future__ import annotations

from collections import Counter

from serve_app.contract import Priority


class ClassConcurrency:
    """Requests in flight on one router, and the ceiling each class may fill it to."""

    def __init__(self, limit: int, normal_share: float = 1.5, high_share: float = 2.0) -> None:
        if limit < 1:
            raise ValueError(f"the router's in-flight limit must be at least 1, got {limit}")
        if not 1.0 <= normal_share <= high_share:
            raise ValueError(f"need 1 <= normal_share <= high_share, got {normal_share}, {high_share}")
        self.ceiling = {
            Priority.LOW: limit,
            Priority.NORMAL: round(limit * normal_share),
            Priority.HIGH: round(limit * high_share),
        }
        self.in_flight = 0
        self.by_class: Counter[Priority] = Counter()
        self.refused: Counter[str] = Counter()  # by priority name, for /router/status

    def enter(self, priority: Priority) -> bool:
        """A request of this class arrives: True when it may go on (it is then in flight until
        `leave`), False when the router is as full as this class may fill it (counted)."""
        if self.in_flight >= self.ceiling[priority]:
            self.refused[priority.name.lower()] += 1
            return False
        self.in_flight += 1
        self.by_class[priority] += 1
        return True

    def leave(self, priority: Priority) -> None:
        """A request that `enter` let in was answered (or failed, or was cancelled)."""
        self.in_flight -= 1
        self.by_class[priority] -= 1

    def status(self) -> dict[str, object]:
        return {
            "in_flight": {p.name.lower(): self.by_class[p] for p in Priority},
            "ceiling": {p.name.lower(): c for p, c in self.ceiling.items()},
            "refused": dict(self.refused),
        }
