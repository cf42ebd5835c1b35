"""How many batches a model may have in flight: learned from what its replicas report.

Why not a fixed number: the right value is "one batch running plus one ready
on every replica", and both the replica count (autoscaling) and the batch
time (model, batch size, hardware) change at run time. Anything above that
only waits inside Ray's FIFO queues, where priority cannot reach it.

Signal: each replica reports, per batch, how long the batch waited before it
started (`wait_s`) and how long it ran (`exec_s`). `wait_s / exec_s` is the
number of batches queued ahead of it on that replica, measured directly, in
the spirit of TCP Vegas' queue estimate but without having to guess a
no-load round trip (which would shift with batch size). The limit grows by
one per window while that queue is below `target_low` and shrinks by one per
window above `target_high`; a failure halves it (AIMD's loss response).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdaptiveLimit:
    initial: float = 2.0
    minimum: float = 1.0
    maximum: float = 64.0
    target_low: float = 0.5  # batches queued per replica below which we add work
    target_high: float = 1.5  # above which we hold back
    smoothing: float = 0.2  # EWMA weight of the newest queue sample

    # A lower bound the caller sets from what it knows of the replicas (a pool model's holders:
    # serve_app.router.routing.dispatchers); never above `maximum`.
    floor: float = 0.0
    # The least `hold_at_least` may lower `floor` to: what the lane itself needs whatever the
    # replicas (one batch per session where two lanes share a replica's sessions: the dispatcher).
    base_floor: float = 0.0

    def __post_init__(self) -> None:
        if not self.minimum <= self.initial <= self.maximum:
            raise ValueError(f"need minimum <= initial <= maximum, got {self.minimum}, {self.initial}, {self.maximum}")
        if not 0 <= self.target_low < self.target_high:
            raise ValueError(f"need 0 <= target_low < target_high, got {self.target_low}, {self.target_high}")
        self.value = self.initial
        self.queue_estimate = 0.0

    @property
    def slots(self) -> int:
        return int(self.value)

    def on_batch(self, wait_s: float, exec_s: float, inflight: int) -> None:
        """Update from one completed batch. `inflight` counts batches outstanding when it was sent.

        The limit only grows while it is actually used: an idle model says
        nothing about how much more it could take.
        """
        sample = wait_s / exec_s if exec_s > 0 else 0.0
        self.queue_estimate += self.smoothing * (sample - self.queue_estimate)
        step = 1.0 / max(self.value, 1.0)  # about +-1 per window of `value` batches
        if self.queue_estimate < self.target_low and inflight >= self.slots:
            self.value = min(self.maximum, self.value + step)
        elif self.queue_estimate > self.target_high:
            self.value = max(self.minimum, self.floor, self.value - step)

    def on_failure(self) -> None:
        self.value = max(self.minimum, self.floor, self.value / 2)

    def hold_at_least(self, floor: float) -> None:
        """Keep the limit at `floor` (never less than `base_floor`) or above from now on, until a
        lower floor is set."""
        self.floor = min(max(floor, self.base_floor), self.maximum)
        self.value = max(self.value, self.floor)
