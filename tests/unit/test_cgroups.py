"""A pod's CPU group (benchmarks/cgroups.py): the kubelet's shares, and a process started in it
staying there with its children; removed with what is left in it."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from benchmarks import cgroups
from benchmarks.cgroups import CpuGroup


def test_shares_follow_the_kubelets_rule():
    assert cgroups.shares(2) == 2048 and cgroups.shares(0.25) == 256 and cgroups.shares(0.001) == cgroups.MIN_SHARES


@pytest.mark.skipif(cgroups.available() is not None, reason=f"no CPU groups here: {cgroups.available()}")
def test_a_process_started_in_a_group_stays_there_with_its_children():
    group = CpuGroup(f"pbtest-{os.getpid()}", 0.5).create()
    try:
        assert (group.path / "cpu.shares").read_text().strip() == "512"
        proc = subprocess.Popen(group.wrap(["/bin/sh", "-c", "sleep 30 & sleep 30"]))
        deadline = time.monotonic() + 10
        while len(group.pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.pid in group.pids() and len(group.pids()) >= 2  # the shell and its children
    finally:
        group.remove()
    assert not group.path.exists()
    proc.wait(timeout=10)
