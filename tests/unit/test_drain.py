"""The worker pod's preStop drain: its steps and retries, on a fake clock; and that the manifest wires it."""

from __future__ import annotations

import yaml

from serve_app.tools.drain import drain, request_drain, wait_until
from serve_app.tools.kuberay import DRAIN_DEADLINE_S, render
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

    assert wait_until(lambda: count() == 0, deadline_s=60, poll_s=2, clock=clock, sleep=sleep)
    assert clock.now == 6


def test_the_drain_gives_up_at_its_deadline():
    clock = Clock()

    def sleep(s: float) -> None:
        clock.now += s

    assert not wait_until(lambda: False, deadline_s=10, poll_s=3, clock=clock, sleep=sleep)
    assert 10 <= clock.now < 13


def test_the_drain_finds_its_node_has_the_drain_accepted_and_waits_for_the_replicas_each_retried():
    """Ray busy at first, the GCS refusing the request once (a restart), then two replicas leaving:
    every step is retried within the one deadline, and the request names this node."""
    clock = Clock()
    calls: list[str] = []
    nodes: list[str | Exception] = [RuntimeError("GCS unreachable"), "abc123"]
    accepted = [False, True]
    left = [2, 1, 0]

    def node() -> str:
        value = nodes.pop(0)
        if isinstance(value, Exception):
            raise value
        return value

    def request(node_id: str, deadline_s: float) -> bool:
        calls.append(f"{node_id} within {deadline_s:.0f}")
        return accepted.pop(0)

    def sleep(s: float) -> None:
        clock.now += s

    assert drain(node, request, lambda n: left.pop(0), deadline_s=60, poll_s=2, clock=clock, sleep=sleep) == "drained"
    assert calls == ["abc123 within 58", "abc123 within 56"]  # the time left goes to the GCS
    assert clock.now == 8


def test_a_drain_the_gcs_never_accepts_ends_at_the_deadline_and_says_so():
    clock = Clock()

    def sleep(s: float) -> None:
        clock.now += s

    said = drain(lambda: "n", lambda n, d: False, lambda n: 1, deadline_s=10, poll_s=3, clock=clock, sleep=sleep)
    assert said == "the drain request was not accepted within 10 s" and clock.now < 13


def test_the_drain_request_names_the_node_and_reports_a_refusal():
    class Done:
        def __init__(self, returncode: int) -> None:
            self.returncode, self.stderr = returncode, "not accepted: node is not alive"

    seen: list[list[str]] = []

    def run(cmd: list[str], **kwargs: object) -> Done:
        seen.append(cmd)
        return Done(1 if len(seen) == 1 else 0)

    assert not request_drain("abc123", 57.6, run)
    assert request_drain("abc123", 0.2, run)
    assert seen[0][:3] == ["ray", "drain-node", "--node-id=abc123"]
    assert seen[0][-1] == "--deadline-remaining-seconds=57" and seen[1][-1] == "--deadline-remaining-seconds=1"


def test_worker_pods_drain_before_they_stop_and_get_the_time_for_it():
    cluster = yaml.safe_load(render(GPU_CONFIG))["spec"]["rayClusterConfig"]
    for group in cluster["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        assert container["lifecycle"]["preStop"]["exec"]["command"][:3] == ["python", "-m", "serve_app.tools.drain"]
        assert pod["terminationGracePeriodSeconds"] > DRAIN_DEADLINE_S
    assert "lifecycle" not in cluster["headGroupSpec"]["template"]["spec"]["containers"][0]  # the head is not drained
