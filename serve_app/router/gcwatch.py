"""How long Python's cyclic garbage collector stops this process, by generation.

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
        for g, recent in self.recent.items():
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
        out["frozen_objects"] = gc.get_freeze_count()
        return out


def freeze_startup_heap() -> int:
    """Move every object alive now out of the collector's reach; returns how many.

    A router's startup heap (Ray, FastAPI, pydantic, the app) lives as long as the
    process, yet every full collection walked it: measured under the 2x flood of
    `serve-app bench priority`, generation-2 pauses of 197 ms (median) to 592 ms, with
    the event loop, and every request on it, stopped. Frozen objects are never
    collected, so collect first: only garbage-free, long-lived state is frozen.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
