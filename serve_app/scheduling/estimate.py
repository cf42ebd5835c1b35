"""How long a request will take, given the work queued ahead of it.

Used at admission: a request whose deadline falls before its predicted
completion is refused before it costs model time.

Two estimates of the wait, for two regimes:
- `LatencyEstimator`, a model of one batch's service time, for a lane with a
  free slot or a short queue: the wait is the batches ahead, `slots` at a time.
- `DrainRate`, the rows per second a lane actually completes while saturated,
  for a lane whose every slot is busy: the wait is the rows ahead over that rate.
  Why both: the in-flight limit counts batches queued at the replica as well as
  running ones (serve_app/scheduling/protection/limit.py keeps one ready per runner), and
  the runners share cores with the router and the urgent lane, so service time
  over slots overstates how fast a backlog drains. Measured on BERT-base under a
  flood (the priority scenario at bench-realsize, before and after this estimate): the model
  predicted a full queue would drain far sooner than
  it did, so the queue-delay bound never refused and the queue ran into its row
  bound instead, on the router's full request path rather than at its header gate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve_app.contract import Priority


@dataclass
class LatencyEstimator:
    """Round trip of a batch as `overhead + (items - 1) * per_item`, learned from completed batches.

    Each batch size seen lately keeps its own service time, as a floor that forgets slowly: a
    faster batch lowers it at once (a cold start's slow first batches are forgotten at the first
    normal one), a slower one raises it by the smoothing weight (a batch slowed by a busy machine
    moves it a little). The line is a least-squares fit through those floors, one point per size,
    so the overhead is what the small batches cost and the per-row cost what each row adds across
    the sizes actually seen. With one size seen lately the slope is unknown and keeps its last
    value. Fitting the line to each batch in turn, as this once did, let one slow batch set a
    steep per-row cost that the next normal batch of the same size then explained as no overhead
    at all: a model whose batch time does not grow with its rows (a GPU at small batches) looked
    free for one row, and admission let through deadlines it could not meet.
    """

    smoothing: float = 0.1
    memory: int = 64  # batches: a size not seen in the last this many leaves the fit
    overhead_s: float = 0.0
    per_item_s: float = 0.0
    samples: int = 0
    # rows -> (floor of its service time in seconds, number of the batch that last had that size)
    _by_size: dict[int, tuple[float, int]] = field(default_factory=dict)

    def observe(self, items: int, rtt_s: float, wait_s: float) -> None:
        """One batch of `items` rows took `rtt_s` at the router, `wait_s` of it queued at the replica."""
        service = max(rtt_s - wait_s, 0.0)
        items = max(items, 1)
        self.samples += 1
        known = self._by_size.get(items)
        floor = service if known is None else min(service, known[0] + self.smoothing * (service - known[0]))
        self._by_size[items] = (floor, self.samples)
        self._by_size = {n: v for n, v in self._by_size.items() if self.samples - v[1] < self.memory}
        sizes = sorted(self._by_size)
        mean_n = sum(sizes) / len(sizes)
        mean_s = sum(self._by_size[n][0] for n in sizes) / len(sizes)
        if len(sizes) > 1:
            spread = sum((n - mean_n) ** 2 for n in sizes)
            slope = sum((n - mean_n) * (self._by_size[n][0] - mean_s) for n in sizes) / spread
            self.per_item_s = max(slope, 0.0)
        self.overhead_s = max(mean_s - (mean_n - 1) * self.per_item_s, 0.0)

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
class _Window:
    """Rows completed from one completion to a later one at least `span_s` after it."""

    span_s: float
    opened: float | None = None
    rows: int = 0

    def add(self, rows: int, now: float) -> float | None:
        """Count a completion; the rows per second of a window that now spans `span_s` (the
        next window opens here), else None."""
        if self.opened is None:
            self.opened, self.rows = now, 0  # rows count from the next completion on
            return None
        self.rows += rows
        elapsed = now - self.opened
        if elapsed < self.span_s:
            return None
        sample = self.rows / elapsed
        self.opened, self.rows = now, 0
        return sample

    def discard(self) -> None:
        self.opened, self.rows = None, 0


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

    What the lane completed in any window, saturated or not, is at most its
    capacity, so a learned rate below it is stale and rises to it. Without that a
    rate learned while the node starved the replicas (a spike that took their
    cores) would outlive the spike: admission refuses what that rate says cannot
    be served in time, the queue stays too short for a saturated window to last,
    and the rate is never measured again.
    """

    window_s: float = 1.0
    smoothing: float = 0.3
    rate: float = 0.0
    _saturated: _Window = field(init=False)
    _any: _Window = field(init=False)

    def __post_init__(self) -> None:
        self._saturated, self._any = _Window(self.window_s), _Window(self.window_s)

    def on_completion(self, rows: int, now: float, saturated: bool) -> None:
        """A batch of `rows` completed at `now`; `saturated`: the lane was saturated when it did."""
        completed = self._any.add(rows, now)
        # Only a learned rate rises: before any saturated window, what an unsaturated lane
        # completes is the offered load, not a capacity to predict waits with.
        if completed is not None and self.rate > 0:
            self.rate = max(self.rate, completed)
        if not saturated:
            self._saturated.discard()
            return
        sample = self._saturated.add(rows, now)
        if sample is not None:
            self.rate = sample if self.rate == 0 else self.rate + self.smoothing * (sample - self.rate)

    def seconds_for(self, rows: int) -> float | None:
        """Seconds to complete `rows` at the learned rate; None before any window closed."""
        return rows / self.rate if self.rate > 0 else None


# The shortest part of an open window whose rate `ArrivalRates.above` reads beside the average.
MIN_WINDOW_S = 0.1


@dataclass
class ArrivalRates:
    """Rows per second admitted to a lane, by class, as an EWMA over windows of `window_s`.

    Under priority queueing a request's wait is not only the rows ahead of it now: every row of a
    higher class admitted while it waits goes ahead too. What is left for a class is the rate the
    lane drains less the rate the classes above it arrive at (`Lane.queue_wait_s`)."""

    window_s: float = 1.0
    smoothing: float = 0.3
    rates: dict[Priority, float] = field(default_factory=lambda: dict.fromkeys(Priority, 0.0))
    _opened: float | None = None
    _rows: dict[Priority, int] = field(default_factory=lambda: dict.fromkeys(Priority, 0))
    _last: dict[Priority, float] = field(default_factory=lambda: dict.fromkeys(Priority, 0.0))  # the last window's own rates

    def on_admission(self, priority: Priority, rows: int, now: float) -> None:
        if self._opened is None:
            self._opened = now
        elapsed = now - self._opened
        if elapsed >= self.window_s:
            # A span of several windows (a quiet spell) weighs as that many windows of its mean rate.
            weight = 1.0 - (1.0 - self.smoothing) ** int(elapsed / self.window_s)
            for p, n in self._rows.items():
                self.rates[p] += weight * (n / elapsed - self.rates[p])
                self._last[p] = n / elapsed
                self._rows[p] = 0
            self._opened = now
        self._rows[priority] += rows

    def above(self, priority: Priority, now: float | None = None) -> float:
        """Rows per second of the classes served before `priority`. Given `now`, the highest of the
        average, the last closed window's own rate and the rate of the window open now (once
        `MIN_WINDOW_S` old). A spike after a quiet spell opens a window, so its rise counts within
        a tenth of a second, not a window and several smoothing steps later, and it keeps counting
        in full across the windows that follow: on the average alone a lower class was admitted on
        the rate before the spike (and again at each window's start, the average lagging it), then
        overtaken by the spike's higher classes until its `max_queued_s` ran out. A rise inside a
        window already open shows at that window's pace, and a fall a window later, on the side of
        refusing the lower class."""

        def above(per_class: dict[Priority, float] | dict[Priority, int]) -> float:
            return sum(n for p, n in per_class.items() if p < priority)  # a lower value is served first

        if now is None or self._opened is None:
            return above(self.rates)
        if (elapsed := now - self._opened) < MIN_WINDOW_S:
            return max(above(self.rates), above(self._last))
        return max(above(self.rates), above(self._last), above(self._rows) / elapsed)
