"""The worker pod's preStop drain: its wait, on a fake clock; and that the manifest wires it."""

from __future__ import annotations

import yaml

from serve_app.drain import wait_until_empty
from serve_app.kuberay import DRAIN_DEADLINE_S, render
from tests.unit.fakes import Clock
from tests.unit.test_kuberay import GPU_CONFIG


def test_the_drain_waits_until_no_replica_is_left_and_rides_out_gcs_errors():
    clock = Clock()
    left: list[int | Exception] = [3, RuntimeError("GCS restarting"), 1, 0]

    def count() -> int:
        value = left.pop(0)
        if isinstance(value, Exception):
            raise value
        return value

    def sleep(s: float) -> None:
        clock.now += s

    assert wait_until_empty(count, deadline_s=60, poll_s=2, clock=clock, sleep=sleep)
    assert clock.now == 6


def test_the_drain_gives_up_at_its_deadline():
    clock = Clock()

    def sleep(s: float) -> None:
        clock.now += s

    assert not wait_until_empty(lambda: 2, deadline_s=10, poll_s=3, clock=clock, sleep=sleep)
    assert 10 <= clock.now < 13


def test_worker_pods_drain_before_they_stop_and_get_the_time_for_it():
    cluster = yaml.safe_load(render(GPU_CONFIG))["spec"]["rayClusterConfig"]
    for group in cluster["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        assert container["lifecycle"]["preStop"]["exec"]["command"][:3] == ["python", "-m", "serve_app.drain"]
        assert pod["terminationGracePeriodSeconds"] > DRAIN_DEADLINE_S
    assert "lifecycle" not in cluster["headGroupSpec"]["template"]["spec"]["containers"][0]  # the head is not drained
