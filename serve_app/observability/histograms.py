"""Per-request histograms whose export costs the node per series, not per request.

Ray's metrics agent takes a histogram's bucket counts from each process and records them again
one observation at a time, so a Ray histogram observed for every request costs the node's agent
work in proportion to the request rate (`ray-system:DashboardAgent` in `bench compare`'s
per-process accounting).

`BucketCounts` bins a batch of values at once and keeps Prometheus's own cumulative series for
a histogram: `<name>_bucket{le=...}`, `<name>_sum` and `<name>_count`. `GaugeHistogram` exports
them as Ray gauges that the router sets every export. A scrape shows the same names and labels as a
Ray histogram, and PromQL's `histogram_quantile(q, rate(<name>_bucket[5m]))` reads them the
same way. A router that restarts starts its series at zero again, which `rate` takes for a
counter reset.
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
    """A bucket's upper bound as Prometheus's Python client writes it (`5.0`, `+Inf`)."""
    return "+Inf" if bound == float("inf") else repr(float(bound))


@dataclass
class _Series:
    counts: np.ndarray  # per bucket, not cumulative; the last is +Inf
    total: float = 0.0


@dataclass
class BucketCounts:
    """Cumulative bucket counts per tag set. Plain data: tested without Ray."""

    boundaries: Sequence[float]
    series: dict[TagKey, _Series] = field(default_factory=dict)
    changed: set[TagKey] = field(default_factory=set)

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
        self.changed.add(key)

    def take_changed(self) -> list[tuple[dict[str, str], list[int], float]]:
        """Each tag set counted into since the last call: its cumulative bucket counts (one per
        `les`, the last the total count) and sum."""
        out = [(dict(k), np.cumsum(self.series[k].counts).tolist(), self.series[k].total) for k in sorted(self.changed)]
        self.changed.clear()
        return out


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
        for le, n in zip(self.counts.les, cumulative, strict=True):
            self.bucket.set(n, tags={**tags, "le": le})
        self.sum.set(total, tags=tags)
        self.count.set(cumulative[-1], tags=tags)

    def flush(self) -> None:
        """Set the series of every tag set that counted something since the last export."""
        for series in self.counts.take_changed():
            self._set(*series)

    async def export(self) -> None:
        """`flush`, yielding to the event loop between tag sets."""
        for series in self.counts.take_changed():
            self._set(*series)
            await asyncio.sleep(0)
