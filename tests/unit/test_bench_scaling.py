"""The scaling scenario's figures from its raw samples: phases, priorities, scale-up and -down times."""

from __future__ import annotations

from benchmarks.scaling import phase_figures, scale_times


def test_records_fall_into_their_phase_and_priority_with_refusals_counted_apart():
    records = [
        ("m/high", 1.0, 10.0, 200, False),
        ("m/low", 2.0, 30.0, 503, True),
        ("m/high", 12.0, 50.0, 200, False),
        ("m/low", 13.0, 0.0, 503, False),  # a refusal without Retry-After
        ("m/low", 14.0, 0.0, 500, False),
        ("m/low", 25.0, 20.0, 200, False),
    ]
    f = phase_figures(records, 10.0, 20.0, 30.0)
    assert f["before"]["high"] == {"requests": 1, "ok": 1, "p50_ms": 10.0, "p99_ms": 10.0, "refused": 0,
                                   "refused_without_retry_after": 0, "failed": 0}  # fmt: skip
    assert f["before"]["low"]["refused"] == 1 and f["before"]["low"]["ok"] == 0 and f["before"]["low"]["p99_ms"] is None
    assert f["spike"]["high"]["ok"] == 1 and f["spike"]["high"]["refused"] == 0
    assert f["spike"]["low"] == {"requests": 2, "ok": 0, "p50_ms": None, "p99_ms": None, "refused": 1,
                                 "refused_without_retry_after": 1, "failed": 1}  # fmt: skip
    assert f["after"]["low"]["ok"] == 1


def test_scale_up_and_down_times_are_read_from_the_replica_samples():
    timeline = [(0.0, 1), (9.5, 1), (10.5, 1), (13.0, 2), (16.0, 3), (21.0, 3), (30.0, 2), (36.0, 1), (40.0, 1)]
    t = scale_times(timeline, 10.0, 20.0)
    assert t == {"replicas_before": 1, "replicas_peak": 3, "first_replica_added_s": 3.0, "peak_reached_s": 6.0,
                 "back_down_s": 16.0, "replicas_at_end": 1}  # fmt: skip
    flat = scale_times([(0.0, 1), (15.0, 1), (25.0, 1)], 10.0, 20.0)
    assert flat["replicas_peak"] == 1 and flat["first_replica_added_s"] is None and flat["back_down_s"] is None
