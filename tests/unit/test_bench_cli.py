"""Every benchmark scenario and load tool answers `--help` (the harness runs as `python -m benchmarks`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from benchmarks import cli, genload, loadgen


@pytest.mark.parametrize("scenario", sorted(cli.SCENARIOS))
def test_every_scenario_has_help(scenario: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.parser().parse_args([scenario, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m benchmarks {scenario}") and "--smoke" in out


@pytest.mark.parametrize("main", [genload.main, loadgen.main])
def test_every_load_tool_has_help(main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "usage: python -m benchmarks." in capsys.readouterr().out


def test_a_scenario_is_required_and_unknown_ones_are_refused() -> None:
    for argv in ([], ["nonsense"]):
        with pytest.raises(SystemExit) as done:
            cli.parser().parse_args(argv)
        assert done.value.code == 2
