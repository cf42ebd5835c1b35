"""How long Python's cyclic garbage collector stops this process, and when it may.

A router holding hundreds of queued requests has a large heap; a full (generation
2) collection walks all of it while the event loop waits, and every request in
flight, high priority or not, waits with it. `/router/status` shows these pauses
so a latency spike can be told apart from queueing.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable
from typing import Any


class GcPauses:
    """Records each collection's duration through `gc.callbacks` (bounded: the last `keep`)."""

    def __init__(self, keep: int = 1024, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        # (when it ended, how long it took) per generation
        self.recent: dict[int, deque[tuple[float, float]]] = {g: deque(maxlen=keep) for g in range(3)}
        self.counts = [0, 0, 0]
        self.total_s = [0.0, 0.0, 0.0]
        self._started: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = self.clock()
        elif self._started is not None:
            now = self.clock()
            pause, generation = now - self._started, int(info["generation"])
            self._started = None
            self.recent[generation].append((now, pause))
            self.counts[generation] += 1
            self.total_s[generation] += pause

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def uninstall(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def snapshot(self, window_s: float = 30.0) -> dict[str, Any]:
        """Per generation: collections so far and their total; the recent ones' p50/p99/max (ms);
        and the last `window_s` seconds' count and max, which is what a load test just saw."""
        now = self.clock()
        out: dict[str, Any] = {}
        for g, live in self.recent.items():
            recent = _copy(live)
            ordered = sorted(p for _, p in recent)
            entry: dict[str, Any] = {"collections": self.counts[g], "total_ms": round(self.total_s[g] * 1e3, 2)}
            if ordered:
                entry.update(
                    {
                        "p50_ms": round(ordered[len(ordered) // 2] * 1e3, 3),
                        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 3),
                        "max_ms": round(ordered[-1] * 1e3, 3),
                    }
                )
            window = [p for t, p in recent if now - t <= window_s]
            entry[f"last_{window_s:g}s"] = {"collections": len(window), "max_ms": round(max(window, default=0.0) * 1e3, 3)}
            out[f"gen{g}"] = entry
        out["frozen_objects"] = frozen_objects()
        return out


def _copy(recent: deque[tuple[float, float]]) -> list[tuple[float, float]]:
    """`recent` as it stands between two of the callback's appends. A collection, and so the
    callback, may start in any thread between any two steps of a loop over the deque, which
    then raises; copying again until one copy completes is enough."""
    while True:
        try:
            return list(recent)
        except RuntimeError:  # deque mutated during iteration
            continue


# How many objects the last `freeze_startup_heap` froze; None before the first. Counting them
# again (`gc.get_freeze_count`) walks every frozen object, a router's whole startup heap, on the
# event loop of whoever asks: `/router/status` reports this count instead.
_frozen: int | None = None


def frozen_objects() -> int:
    """Objects out of the collector's reach: as counted when this process last froze its heap
    here (nothing unfreezes it); counted once now if it never did."""
    global _frozen
    if _frozen is None:
        _frozen = gc.get_freeze_count()
    return _frozen


def freeze_startup_heap() -> int:
    """Move every object alive now out of the collector's reach; returns how many.

    A router's startup heap (Ray, FastAPI, pydantic, the app) lives as long as the
    process, yet every full collection walked it, with the event loop, and every
    request on it, stopped (the generation-2 pauses of `python -m benchmarks priority` are
    `router_gc` in benchmarks/results/priority/bench-realsize/). Frozen objects are never
    collected, so collect first: only garbage-free, long-lived state is frozen.
    """
    global _frozen
    gc.collect()
    gc.freeze()
    _frozen = gc.get_freeze_count()
    return _frozen


class FullCollectionSchedule:
    """When the router runs full (generation-2) collections itself, instead of Python.

    Python starts a full collection whenever enough objects have survived, which under a
    flood is often, each stopping the event loop for long enough to show in the tail (see
    `GcPauses`). With Python's own full collections turned off (`take_over`), the router
    runs one when it has been idle for `idle_s` (no queued or running work: nobody waits
    on the pause), and at the latest `max_interval_s` after the last one, so memory held
    by cyclic garbage stays bounded under a flood that never ends. Generations 0 and 1
    keep Python's schedule: they are short and free most garbage (`router_gc` in
    benchmarks/results/priority/bench-realsize/).
    """

    def __init__(self, idle_s: float = 1.0, max_interval_s: float = 120.0, clock: Callable[[], float] = time.monotonic):
        self.idle_s, self.max_interval_s, self.clock = idle_s, max_interval_s, clock
        self.last_full = clock()
        self.idle_since: float | None = None

    def due(self, busy: bool) -> bool:
        """Called periodically with whether any request is queued or running."""
        now = self.clock()
        if busy:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = now
        if now - self.last_full >= self.max_interval_s:
            return True
        # Only once per idle spell: an idle router is not collected over and over.
        return self.idle_since is not None and now - self.idle_since >= self.idle_s and self.last_full < self.idle_since

    def ran(self) -> None:
        self.last_full = self.clock()

    @staticmethod
    def take_over() -> None:
        """Keep Python's generation 0 and 1 thresholds; never start a full collection itself
        (generation 2 runs after this many generation-1 collections: effectively never)."""
        t0, t1, _ = gc.get_threshold()
        gc.set_threshold(t0, t1, 1_000_000_000)
