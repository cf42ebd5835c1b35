"""The lifecycle scenario's shadow statistics, without Ray."""

from benchmarks.lifecycle import pair_ratio_interval


def test_the_interval_brackets_the_pairs_geometric_mean_and_narrows_when_they_agree():
    spread = [{"p99_ratio": r} for r in (0.5, 2.0, 0.8, 1.25)]
    wide = pair_ratio_interval(spread)
    assert wide is not None and wide["geomean"] == 1.0
    assert wide["low"] < 1.0 < wide["high"]
    same = pair_ratio_interval([{"p99_ratio": 1.2}] * 4)
    assert same == {"geomean": 1.2, "low": 1.2, "high": 1.2}


def test_one_pair_or_pairs_without_a_ratio_give_no_interval():
    assert pair_ratio_interval([{"p99_ratio": 1.1}]) is None
    assert pair_ratio_interval([{"p99_ratio": None}, {"p99_ratio": 1.1}]) is None
