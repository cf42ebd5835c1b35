"""The goodput scenario's figures from the load generator's output, without Ray."""

from __future__ import annotations

from typing import Any

from benchmarks.goodput import MIXES, checks, refusals, summary


def _stream(statuses: dict[str, int], p99: float | None = 20.0, dropped: int = 0) -> dict[str, object]:
    return {
        "requests": sum(statuses.values()),
        "statuses": statuses,
        "p50_ms": 5.0,
        "p99_ms": p99,
        "refused_p50_ms": 2.0,
        "refused_p99_ms": 9.0,
        "refused_without_retry_after": 0,
        "timeouts": statuses.get("0", 0),
        "client_dropped": dropped,
    }


def _load(**classes: dict[str, object]) -> dict[str, object]:
    merged: dict[str, int] = {}
    for c in classes.values():
        for code, n in c["statuses"].items():  # type: ignore[attr-defined]
            merged[code] = merged.get(code, 0) + n
    return {
        "statuses": merged,
        "goodput_rps": 90.0,
        "timeouts": merged.get("0", 0),
        "refused_without_retry_after": 0,
        "refused_p99_ms": 9.0,
        "streams": {f"m/{name}": c for name, c in classes.items()},
    }


def test_a_point_reports_goodput_over_capacity_and_each_class_s_share():
    load = _load(
        high=_stream({"200": 10}),
        normal=_stream({"200": 27, "503": 3}),
        low=_stream({"200": 30, "503": 25, "0": 5}, dropped=0),
    )
    got = summary(load, capacity_rps=100.0)
    assert got["goodput_over_capacity"] == 0.9 and got["timeouts"] == 5 and got["server_errors_5xx"] == 0
    assert got["classes"]["high"]["answered_share"] == 1.0
    assert got["classes"]["normal"]["answered_share"] == 0.9 and got["classes"]["normal"]["refused"] == 3
    assert got["classes"]["low"]["answered_share"] == 0.5 and got["classes"]["low"]["timeouts"] == 5


def test_a_500_counts_as_a_server_error_and_a_503_does_not():
    got = summary(_load(normal=_stream({"200": 5, "503": 2, "500": 1})), capacity_rps=10.0)
    assert got["server_errors_5xx"] == 1


def test_the_checks_read_the_acceptance_rows():
    high = _stream({"200": 10}, p99=30.0)
    points = [
        {"mix": "trickle", "load": 0.9, "result": summary(_load(high=high, normal=_stream({"200": 99, "503": 1})), 100.0)},
        {"mix": "10/30/60", "load": 1.5, "result": summary(
            _load(high=high, normal=_stream({"200": 20, "503": 10}), low=_stream({"200": 10, "503": 50})), 100.0)},
    ]  # fmt: skip
    got = checks({"unloaded_high": {"p99_ms": 15.0}, "points": points})
    assert got["at_or_below_0.9x"] == [{"mix": "trickle", "load": 0.9, "min_answered_share": 0.99}]
    (over,) = got["over_capacity_10_30_60"]
    assert over["high_p99_over_unloaded"] == 2.0 and over["normal_at_least_low"] and over["high_answered_share"] == 1.0


def test_the_mixes_are_shares_of_a_hundred_and_leave_classes_out_where_named():
    assert all(sum(mix) == 100 for mix in MIXES.values())
    assert MIXES["no-high"][0] == 0 and MIXES["trickle"][2] == 0 and MIXES["10/30/60"] == (10, 30, 60)


def test_the_degrade_table_takes_each_arm_s_median_over_rounds_and_pools_accuracy():
    from benchmarks.goodput import degrade_table

    def point(arm: str, rnd: int, goodput: float, scored: dict[str, Any]) -> dict[str, Any]:
        result = {"goodput_over_capacity": goodput, "scored": scored, "timeouts": 0, "server_errors_5xx": 0}
        return {"mix": "10/30/60", "load": 3.0, "degrade": arm, "round": rnd, "result": result}

    on = {"answers": 100, "accuracy": 0.9, "degraded": 40, "degraded_accuracy": 0.8, "unmarked_accuracy": 0.967}
    off = {"answers": 50, "accuracy": 0.99, "degraded": 0, "degraded_accuracy": None, "unmarked_accuracy": 0.99}
    points = [point("on", 0, 0.9, on), point("off", 0, 0.5, off), point("off", 1, 0.4, off), point("on", 1, 1.1, on),
              point("on", 2, 1.0, on), point("off", 2, 0.6, off)]  # fmt: skip
    (row,) = degrade_table(points)
    assert row["on"]["goodput_over_capacity"] == 1.0 and row["on"]["range"] == [0.9, 1.1]
    assert row["off"]["goodput_over_capacity"] == 0.5 and row["on_over_off"] == 2.0
    assert row["on"]["degraded_share"] == 0.4 and row["on"]["degraded_accuracy"] == 0.8
    assert row["off"]["degraded_share"] == 0.0 and row["off"]["degraded_accuracy"] is None


def test_a_strict_copy_of_the_route_never_degrades_and_inputs_come_from_the_heavy_tier(tmp_path):
    from benchmarks.goodput import STRICT_SUFFIX, target_dir, with_strict_route

    config = {"applications": [{"args": {"routes": {"r": {"light": "l", "heavy": "h"}}}}]}
    strict = with_strict_route(config, "r")
    routes = strict["applications"][0]["args"]["routes"]
    assert routes["r" + STRICT_SUFFIX] == {"light": "l", "heavy": "h", "degrade": {"priorities": []}}
    assert "degrade" not in routes["r"] and len(config["applications"][0]["args"]["routes"]) == 1
    assert target_dir(config, tmp_path, "r") == tmp_path / "h" and target_dir(config, tmp_path, "m") == tmp_path / "m"


def test_a_run_given_its_capacity_says_so_beside_the_one_it_measured():
    from dataclasses import asdict

    from benchmarks.goodput import GoodputSettings, markdown

    def report(settings: GoodputSettings) -> str:
        result = {
            "settings": asdict(settings), "scheduling": {}, "capacity": {"goodput_rps": 912.0},
            "unloaded_high": {"p50_ms": 5.0, "p99_ms": 20.0}, "points": [], "checks": {},
        }  # fmt: skip
        return markdown({"result": result})

    assert "Capacity: 912.0 req/s" in report(GoodputSettings()) and "--capacity-rps" not in report(GoodputSettings())
    given = report(GoodputSettings(capacity_rps=750.0))
    assert "Capacity: 912.0 req/s" in given and "goodput are over 750.0 req/s, given with --capacity-rps" in given


def test_the_capacity_measured_again_after_the_points_is_reported_over_the_first():
    from dataclasses import asdict

    from benchmarks.goodput import GoodputSettings, checks, markdown

    result: dict[str, Any] = {
        "settings": asdict(GoodputSettings()), "scheduling": {}, "capacity": {"goodput_rps": 800.0},
        "capacity_after": {"goodput_rps": 440.0}, "unloaded_high": {"p50_ms": 5.0, "p99_ms": 20.0}, "points": [],
    }  # fmt: skip
    result["checks"] = checks(result)
    assert result["checks"]["capacity_after_over_before"] == 0.55
    assert "measured again after the points: 440.0 req/s (0.55 of the first)" in markdown({"result": result})
    assert checks({**result, "capacity_after": None})["capacity_after_over_before"] is None  # runs before it


def test_a_point_s_refusals_are_what_the_queue_counted_between_its_start_and_its_end():
    start = {"reason": {"queue_budget": 5}, "class": {"low": 5}}
    end = {"reason": {"queue_budget": 25, "starved": 3, "evicted": 0}, "class": {"low": 23, "normal": 2}}
    assert refusals([start, {"reason": {}, "class": {}}, end]) == {
        "refused_by_reason": {"queue_budget": 20, "starved": 3},
        "refused_by_class": {"low": 18, "normal": 2},
    }
    assert refusals([start]) == {}  # the end never read: nothing claimed
