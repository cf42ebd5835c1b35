"""How long a request will take, given the work queued ahead of it.

Used at admission: a request whose deadline falls before its predicted
completion is refused before it costs model time.

Two estimates of the wait, for two regimes:
- `LatencyEstimator`, a model of one batch's service time, for a lane with a
  free slot or a short queue: the wait is the batches ahead, `slots` at a time.
- `DrainRate`, the rows per second a lane actually completes while saturated,
  for a lane whose every slot is busy: the wait is the rows ahead over that rate.
  Why both: the in-flight limit counts batches queued at the replica as well as
  running ones (serve_app/scheduling/limit.py keeps one ready per runner), and
  the runners share cores with the router and the urgent lane, so service time
  over slots overstates how fast a backlog drains. Measured on BERT-base under a
  flood (benchmarks/results/priority/bench-realsize/runs/42857cc-base/ against
  runs/drain-rate/): the model predicted a full queue would drain far sooner than
  it did, so the queue-delay bound never refused and the queue ran into its row
  bound instead, on the router's full request path rather than at its header gate.
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

    def wait_s(self, items_ahead: int, batch_size: int, slots: int, inflight: int, inflight_items: int = 0) -> float:
        """Predicted seconds before a request queued behind `items_ahead` rows and `inflight`
        running batches (`inflight_items` rows between them) starts its own batch."""
        if self.samples == 0:
            return 0.0  # nothing learned yet: admit, and learn
        # Every slot busy: wait for one running batch (of the size actually running) to end.
        slot_wait = self.batch_s(-(-inflight_items // inflight)) if inflight and inflight >= slots else 0.0
        # Rows ahead leave in full batches, `slots` batches at a time.
        rounds = -(-items_ahead // max(batch_size, 1)) / max(slots, 1)
        return slot_wait + rounds * self.batch_s(batch_size)

    def completion_s(
        self, items_ahead: int, items: int, batch_size: int, slots: int, inflight: int, inflight_items: int = 0
    ) -> float:
        """Predicted seconds until a request of `items` rows completes: the wait, then its own batch
        (0 before any batch was seen: admit, and learn)."""
        return self.wait_s(items_ahead, batch_size, slots, inflight, inflight_items) + self.batch_s(items)

    def drain_s(self, items: int, batch_size: int, slots: int) -> float:
        """Seconds to serve `items` queued rows: what Retry-After tells a refused client."""
        return self.completion_s(items, 0, batch_size, slots, 0)


@dataclass
class DrainRate:
    """Rows per second a lane completes while saturated, as an EWMA over windows of `window_s`.

    A window only counts time the lane was saturated from one batch completion to
    the next (every slot busy and rows still queued), so the rate is the lane's
    capacity as the replicas deliver it right now (their number, their batch size,
    the cores the rest of the node leaves them), not the offered load. The first
    saturated completion opens a window; any unsaturated one discards it. `rate`
    stays 0 until one window closes, and keeps its last value while the lane is
    not saturated (it is only used while it is: `Dispatcher`).
    """

    window_s: float = 1.0
    smoothing: float = 0.3
    rate: float = 0.0
    _opened: float | None = None
    _rows: int = 0

    def on_completion(self, rows: int, now: float, saturated: bool) -> None:
        """A batch of `rows` completed at `now`; `saturated`: the lane was saturated when it did."""
        if not saturated:
            self._opened, self._rows = None, 0
            return
        if self._opened is None:
            self._opened, self._rows = now, 0  # rows count from the next completion on
            return
        self._rows += rows
        elapsed = now - self._opened
        if elapsed >= self.window_s:
            sample = self._rows / elapsed
            self.rate = sample if self.rate == 0 else self.rate + self.smoothing * (sample - self.rate)
            self._opened, self._rows = now, 0

    def seconds_for(self, rows: int) -> float | None:
        """Seconds to complete `rows` at the learned rate; None before any window closed."""
        return rows / self.rate if self.rate > 0 else None
