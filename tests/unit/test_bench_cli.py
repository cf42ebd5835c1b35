"""Every benchmark scenario and probe answers `--help` (the harness runs as `python -m benchmarks`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from benchmarks import cli, genload, lane_interference, loadgen, refusal_cost, router_probe, shape_warmup


@pytest.mark.parametrize("scenario", sorted(cli.SCENARIOS))
def test_every_scenario_has_help(scenario: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.parser().parse_args([scenario, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m benchmarks {scenario}") and "--smoke" in out


@pytest.mark.parametrize(
    "main", [refusal_cost.main, lane_interference.main, router_probe.main, shape_warmup.main, genload.main, loadgen.main]
)
def test_every_probe_has_help(main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "usage: python -m benchmarks." in capsys.readouterr().out


def test_a_scenario_is_required_and_unknown_ones_are_refused() -> None:
    for argv in ([], ["nonsense"]):
        with pytest.raises(SystemExit) as done:
            cli.parser().parse_args(argv)
        assert done.value.code == 2


def test_router_probe_counts_requests_per_call_and_cpu_per_request() -> None:
    before = {"batches": 10, "completed_items": 40}
    after = {"batches": 30, "completed_items": 160}
    assert router_probe.batches_between(before, after) == {"batches": 20, "items": 120, "items_per_batch": 6.0}
    assert router_probe.batches_between(before, before)["items_per_batch"] == 0.0  # no call: no ratio
    load = {"goodput_rps": 200.0, "cpu_cores_by_role": {"replica:router": 0.5, "replica:m": 0.8}}
    # 0.8 cores over 200 req/s is 4 core-ms a request; the costliest role comes first
    assert list(router_probe.per_request(load).items()) == [("replica:m", 4.0), ("replica:router", 2.5)]
    assert router_probe.per_request({"goodput_rps": 0, "cpu_cores_by_role": {}}) == {}
