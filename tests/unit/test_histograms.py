"""Per-request histograms binned in bulk and exported as a histogram's cumulative series."""

from __future__ import annotations

import asyncio
import random

import pytest

from serve_app.observability.histograms import BucketCounts, GaugeHistogram, le_label


class FakeGauge:
    def __init__(self) -> None:
        self.values: dict[tuple[tuple[str, str], ...], float] = {}
        self.sets = 0

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values[tuple(sorted((tags or {}).items()))] = value
        self.sets += 1


def test_each_value_counts_in_every_bucket_at_or_above_it_as_prometheus_does() -> None:
    bounds = [1.0, 2.0, 5.0]
    values = [random.uniform(0, 8) for _ in range(1000)] + [1.0, 2.0, 5.0, 0.0, 100.0]
    h = BucketCounts(bounds)
    h.add({"model": "m"}, values[:500])
    h.add({"model": "m"}, values[500:])
    [(tags, cumulative, total)] = h.snapshot()
    assert tags == {"model": "m"}
    assert cumulative == [sum(v <= b for v in values) for b in bounds] + [len(values)]
    assert total == pytest.approx(sum(values))
    assert h.les == ["1.0", "2.0", "5.0", "+Inf"]


def test_counts_stay_cumulative_per_tag_set_and_every_tag_set_is_in_each_snapshot() -> None:
    h = BucketCounts([10.0])
    h.add({"p": "high"}, [1.0])
    h.add({"p": "low"}, [20.0])
    h.add({"p": "low"}, [])
    assert [(t["p"], c) for t, c, _ in h.snapshot()] == [("high", [1, 1]), ("low", [0, 1])]
    h.add({"p": "low"}, [3.0])
    assert [(t["p"], c) for t, c, _ in h.snapshot()] == [("high", [1, 1]), ("low", [1, 2])]


@pytest.mark.parametrize("bounds", [[], [2.0, 1.0], [1.0, 1.0]])
def test_boundaries_must_increase(bounds: list[float]) -> None:
    with pytest.raises(ValueError):
        BucketCounts(bounds)


def test_le_labels_are_written_as_rays_exporter_writes_a_histograms() -> None:
    assert [le_label(b) for b in (1, 2.5, 5000.0, float("inf"))] == ["1.0", "2.5", "5000.0", "+Inf"]


def test_the_export_sets_bucket_sum_and_count_of_every_tag_set_each_time() -> None:
    h = GaugeHistogram("x_ms", "X", [1.0, 5.0], ("model",))
    h.bucket, h.sum, h.count = FakeGauge(), FakeGauge(), FakeGauge()  # type: ignore[assignment]
    h.add({"model": "a"}, [0.5, 3.0, 9.0])
    h.add({"model": "b"}, [4.0])
    asyncio.run(h.export())
    assert h.bucket.values == {  # type: ignore[attr-defined]
        (("le", "1.0"), ("model", "a")): 1,
        (("le", "5.0"), ("model", "a")): 2,
        (("le", "+Inf"), ("model", "a")): 3,
        (("le", "1.0"), ("model", "b")): 0,
        (("le", "5.0"), ("model", "b")): 1,
        (("le", "+Inf"), ("model", "b")): 1,
    }
    assert h.sum.values == {(("model", "a"),): 12.5, (("model", "b"),): 4.0}  # type: ignore[attr-defined]
    assert h.count.values == {(("model", "a"),): 3, (("model", "b"),): 1}  # type: ignore[attr-defined]
    h.add({"model": "b"}, [0.1])
    sets = h.bucket.sets  # type: ignore[attr-defined]
    h.flush()
    # a's series too: Ray forgets a gauge once exported, and a quiet series must stay in the scrape
    assert h.bucket.sets - sets == 6  # type: ignore[attr-defined]
    assert h.count.values[(("model", "b"),)] == 2  # type: ignore[attr-defined]


def test_a_series_is_set_largest_bucket_first() -> None:
    order: list[str] = []

    class Recording(FakeGauge):
        def set(self, value: float, tags: dict[str, str] | None = None) -> None:
            order.append((tags or {}).get("le", "count"))

    h = GaugeHistogram("x_ms", "X", [1.0, 5.0], ("model",))
    h.bucket = h.count = Recording()  # type: ignore[assignment]
    h.sum = FakeGauge()  # type: ignore[assignment]
    h.add({"model": "a"}, [0.5])
    h.flush()
    assert order == ["count", "+Inf", "5.0", "1.0"]


def test_the_decode_loop_bins_token_latencies_and_sets_its_series_every_export_s() -> None:
    from types import SimpleNamespace

    from serve_app.models.generation.generator import GenerationMetrics

    now = [100.0]
    m = GenerationMetrics("gpt", clock=lambda: now[0])
    for h in (m.ttft, m.itl):
        h.bucket, h.sum, h.count = FakeGauge(), FakeGauge(), FakeGauge()  # type: ignore[assignment]
    m.running = FakeGauge()  # type: ignore[assignment]
    cache = SimpleNamespace(used_slots=1, used_positions=8, capacity_positions=64)
    step = SimpleNamespace(generated_tokens=0, last_step_latencies=[("ttft", 0.030), ("itl", 0.004), ("itl", 0.006)])
    scheduler = SimpleNamespace(running=[1], waiting=[], cache=cache, stats=step)
    m.update(scheduler)  # type: ignore[arg-type]  # the first step exports at once
    assert m.ttft.count.values == {(("model", "gpt"),): 1}  # type: ignore[attr-defined]
    assert m.itl.count.values == {(("model", "gpt"),): 2}  # type: ignore[attr-defined]
    assert m.running.values == {(): 1}  # type: ignore[attr-defined]
    now[0] += m.EXPORT_S / 2
    m.update(scheduler)  # type: ignore[arg-type]  # binned, not yet exported
    assert m.itl.count.values == {(("model", "gpt"),): 2}  # type: ignore[attr-defined]
    now[0] += m.EXPORT_S / 2
    m.update(scheduler)  # type: ignore[arg-type]
    assert m.itl.count.values == {(("model", "gpt"),): 6}  # type: ignore[attr-defined]
    scheduler.running = []
    m.refresh(scheduler)  # type: ignore[arg-type]  # the loop ran out of work
    assert m.running.values == {(): 0}  # type: ignore[attr-defined]
    assert m.ttft.bucket.values[(("le", "50.0"), ("model", "gpt"))] == 3  # type: ignore[attr-defined]
