"""How long a request will take, given the work queued ahead of it.

Used at admission: a request whose deadline falls before its predicted
completion is refused before it costs model time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LatencyEstimator:
    """Round trip of a batch as `overhead + items * per_item`, learned from completed batches.

    The overhead tracks the smallest recent service time (a one-row batch) and
    the per-item cost what each row adds on top, so `batch_s` is a line through
    the small and the full batches actually seen. With `slots` batches in
    flight, queued rows drain `slots` batches at a time.
    """

    smoothing: float = 0.1
    overhead_s: float = 0.0
    per_item_s: float = 0.0
    samples: int = 0

    def observe(self, items: int, rtt_s: float, wait_s: float) -> None:
        """One batch of `items` rows took `rtt_s` at the router, `wait_s` of it queued at the replica."""
        service = max(rtt_s - wait_s, 0.0)
        a = self.smoothing
        # The intercept this batch implies, given the per-row cost learned so far.
        intercept = max(service - max(items - 1, 0) * self.per_item_s, 0.0)
        if self.samples == 0:
            self.overhead_s = intercept
        else:
            # A floor that forgets slowly: falls at once, rises by the smoothing weight.
            self.overhead_s = min(intercept, self.overhead_s + a * (intercept - self.overhead_s))
        if items > 1:
            per_item = max(service - self.overhead_s, 0.0) / (items - 1)
            self.per_item_s += (a if self.per_item_s else 1.0) * (per_item - self.per_item_s)
        self.samples += 1

    def batch_s(self, items: int) -> float:
        return self.overhead_s + max(items - 1, 0) * self.per_item_s

    def completion_s(
        self, items_ahead: int, items: int, batch_size: int, slots: int, inflight: int, inflight_items: int = 0
    ) -> float:
        """Predicted seconds until a request of `items` rows completes, queued behind `items_ahead`
        rows and `inflight` running batches (`inflight_items` rows between them)."""
        if self.samples == 0:
            return 0.0  # nothing learned yet: admit, and learn
        # Every slot busy: wait for one running batch (of the size actually running) to end.
        slot_wait = self.batch_s(-(-inflight_items // inflight)) if inflight and inflight >= slots else 0.0
        # Rows ahead leave in full batches, `slots` batches at a time.
        rounds = -(-items_ahead // max(batch_size, 1)) / max(slots, 1)
        return slot_wait + rounds * self.batch_s(batch_size) + self.batch_s(items)

    def drain_s(self, items: int, batch_size: int, slots: int) -> float:
        """Seconds to serve `items` queued rows: what Retry-After tells a refused client."""
        return self.completion_s(items, 0, batch_size, slots, 0)
