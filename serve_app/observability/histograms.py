"""Per-request histograms whose export costs the node per series, not per request.

Ray's metrics agent takes a histogram's bucket counts from each process and records them again
one observation at a time, so a Ray histogram observed for every request costs the node's agent
work in proportion to the request rate (`ray-system:DashboardAgent` in `bench compare`'s
per-process accounting).

`BucketCounts` bins a batch of values at once and keeps Prometheus's cumulative series for a
histogram: `<name>_bucket{le=...}`, `<name>_sum` and `<name>_count`. `GaugeHistogram` exports
them as Ray gauges, every series on every export: Ray forgets a gauge's value once it has
exported it, and its agent drops a series it has not heard of for two report intervals, so a
quiet series must be set again to stay in the scrape.

A scrape shows the names and labels of a Ray histogram's series (`# TYPE` says gauge), and
PromQL's `histogram_quantile(q, rate(<name>_bucket[5m]))` reads them the same way. `_sum` is
the exact sum, where Ray's agent estimates one from bucket midpoints. Each replica's series carry
its `replica` tag, so a replacement starts series of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
from ray.serve import metrics

TagKey = tuple[tuple[str, str], ...]


def tag_keys(*keys: str) -> tuple[str]:
    """Tag keys as Ray's metrics take them: Ray annotates `tag_keys` as `Tuple[str]` (one key)
    but accepts any number; the cast keeps mypy on the rest of the call."""
    return cast("tuple[str]", keys)


def le_label(bound: float) -> str:
    """A bucket's upper bound as Ray's exporter writes a histogram's (`5.0`, `+Inf`): the
    dashboards and rule tests match on it."""
    return "+Inf" if bound == float("inf") else f"{float(bound)}"


@dataclass
class _Series:
    counts: np.ndarray  # per bucket, not cumulative; the last is +Inf
    total: float = 0.0


@dataclass
class BucketCounts:
    """Cumulative bucket counts per tag set. Plain data: tested without Ray."""

    boundaries: Sequence[float]
    series: dict[TagKey, _Series] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bounds = [float(b) for b in self.boundaries]
        if bounds != sorted(set(bounds)) or not bounds:
            raise ValueError(f"histogram boundaries must be increasing and distinct: {self.boundaries}")
        self._bounds = np.asarray(bounds)
        self.les = [le_label(b) for b in bounds] + ["+Inf"]

    def add(self, tags: dict[str, str], values: Iterable[float]) -> None:
        """Count `values` under `tags`: each goes to the first bucket whose bound is at or above it."""
        v = np.fromiter(values, dtype=np.float64)
        if not v.size:
            return
        key = tuple(sorted(tags.items()))
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = _Series(np.zeros(len(self.les), dtype=np.int64))
        s.counts += np.bincount(np.searchsorted(self._bounds, v, side="left"), minlength=len(self.les))
        s.total += float(v.sum())

    def snapshot(self) -> list[tuple[dict[str, str], list[int], float]]:
        """Every tag set counted into so far: its cumulative bucket counts (one per `les`, the
        last the total count) and sum."""
        return [(dict(k), np.cumsum(s.counts).tolist(), s.total) for k, s in sorted(self.series.items())]


class GaugeHistogram:
    """`BucketCounts` exported through Ray's metrics as a histogram's three series."""

    def __init__(self, name: str, description: str, boundaries: Sequence[float], keys: tuple[str, ...]) -> None:
        self.counts = BucketCounts(boundaries)
        self.bucket = metrics.Gauge(
            f"{name}_bucket", description=f"{description} (cumulative count at or below `le`)", tag_keys=tag_keys(*keys, "le")
        )
        self.sum = metrics.Gauge(f"{name}_sum", description=f"{description} (sum)", tag_keys=tag_keys(*keys))
        self.count = metrics.Gauge(f"{name}_count", description=f"{description} (count)", tag_keys=tag_keys(*keys))

    def add(self, tags: dict[str, str], values: Iterable[float]) -> None:
        self.counts.add(tags, values)

    def _set(self, tags: dict[str, str], cumulative: list[int], total: float) -> None:
        # Largest first: Ray may export between two of these sets, and a scrape that sees only
        # part of them still sees counts that grow with `le`.
        self.count.set(cumulative[-1], tags=tags)
        for le, n in reversed(list(zip(self.counts.les, cumulative, strict=True))):
            self.bucket.set(n, tags={**tags, "le": le})
        self.sum.set(total, tags=tags)

    def flush(self) -> None:
        """Set every series now."""
        for series in self.counts.snapshot():
            self._set(*series)

    async def export(self) -> None:
        """`flush`, yielding to the event loop between tag sets."""
        for series in self.counts.snapshot():
            self._set(*series)
            await asyncio.sleep(0)
