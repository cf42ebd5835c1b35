"""Work that routers hold for a model, as the model's replicas last heard it.

Each batch a router sends carries how much more it still holds for that
model; the replica keeps the latest figure per router and reports the sum to
Serve's autoscaler (`record_autoscaling_stats`). A router that stops sending
stops counting after `ttl_s`, so the demand fades when load ends.
"""

from __future__ import annotations


class RouterLoad:
    METRIC = "router_queued_batches"

    def __init__(self, ttl_s: float = 5.0) -> None:
        self.ttl_s = ttl_s
        self._latest: dict[str, tuple[float, float]] = {}  # router -> (batches, when)

    def report(self, router: str, batches: float, now: float) -> None:
        self._latest[router] = (batches, now)

    def total(self, now: float) -> float:
        self._latest = {r: v for r, v in self._latest.items() if now - v[1] <= self.ttl_s}
        return sum(b for b, _ in self._latest.values())
