"""Clients elsewhere (benchmarks/cores.py): the split of the cores, and a server process really
started on the server's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks import cores
from benchmarks.cores import CorePlan


def test_the_client_takes_the_highest_core_and_the_server_the_rest():
    assert CorePlan.split({0, 1, 2, 3}) == CorePlan("3", "0,1,2")
    assert CorePlan.split({0, 1}, client="0") == CorePlan("0", "1")
    assert CorePlan.split({0, 1, 2}, client="2", server="0-1") == CorePlan("2", "0,1")
    assert CorePlan.split({5}).shared  # one core cannot be split


@pytest.mark.parametrize(("client", "server"), [("0", "0-1"), ("7", None), ("0-1", None)])
def test_overlapping_missing_or_empty_splits_are_refused(client: str, server: str | None):
    with pytest.raises(ValueError):
        CorePlan.split({0, 1}, client=client, server=server)


def test_the_report_says_which_plan_ran(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(cores.SERVER_CORES_ENV, raising=False)
    assert cores.in_force() == {"shared": True} == CorePlan(None, None).record()
    assert cores.server_argv(["ray", "start"]) == ["ray", "start"]
    monkeypatch.setenv(cores.SERVER_CORES_ENV, "0")
    monkeypatch.setenv(cores.CLIENT_CORES_ENV, "1")
    assert cores.in_force() == {"client_cores": "1", "server_cores": "0"} == CorePlan("1", "0").record()


@pytest.mark.skipif(len(cores.usable_cores()) < 2, reason="needs two usable cores")
def test_a_server_process_runs_on_the_server_cores_only(monkeypatch: pytest.MonkeyPatch):
    plan = CorePlan.split(cores.usable_cores())
    assert plan.server is not None
    monkeypatch.setenv(cores.SERVER_CORES_ENV, plan.server)
    argv = cores.server_argv([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"])
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(sorted(cores.parse(plan.server)))
    assert os.sched_getaffinity(0) == cores.usable_cores()  # the test's own process untouched
