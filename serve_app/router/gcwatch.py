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
        self.recent: dict[int, deque[float]] = {g: deque(maxlen=keep) for g in range(3)}
        self.counts = [0, 0, 0]
        self.total_s = [0.0, 0.0, 0.0]
        self._started: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = self.clock()
        elif self._started is not None:
            pause, generation = self.clock() - self._started, int(info["generation"])
            self._started = None
            self.recent[generation].append(pause)
            self.counts[generation] += 1
            self.total_s[generation] += pause

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def uninstall(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def snapshot(self) -> dict[str, Any]:
        """Per generation: collections so far, their total, and the recent ones' p50/p99/max (ms)."""
        out: dict[str, Any] = {}
        for g, recent in self.recent.items():
            ordered = sorted(recent)
            entry: dict[str, Any] = {"collections": self.counts[g], "total_ms": round(self.total_s[g] * 1e3, 2)}
            if ordered:
                entry.update(
                    {
                        "p50_ms": round(ordered[len(ordered) // 2] * 1e3, 3),
                        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 3),
                        "max_ms": round(ordered[-1] * 1e3, 3),
                    }
                )
            out[f"gen{g}"] = entry
        out["frozen_objects"] = gc.get_freeze_count()
        return out
