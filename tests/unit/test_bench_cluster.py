"""A kept Ray (benchmarks.cluster.REUSE_ENV) is reused only by a cluster with its settings, and
only while the GCS that was marked still runs. No Ray here: the GCS process is a stand-in."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks import cluster
from benchmarks.cluster import Ingress, RayCluster


@dataclass
class FakeGcs:
    pid: int
    started: float

    def create_time(self) -> float:
        return self.started


@pytest.fixture
def gcs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[FakeGcs | None]:
    running: list[FakeGcs | None] = [FakeGcs(4242, 1700000000.25)]
    monkeypatch.setattr(cluster, "_gcs", lambda: running[0])
    monkeypatch.setattr(cluster, "REUSE_MARKER", tmp_path / "marker.json")
    return running


def _cluster(tmp_path: Path, haproxy: bool = True) -> RayCluster:
    return RayCluster(Ingress(haproxy=haproxy), tmp_path, tmp_path / "models")


def test_a_marked_ray_is_found_by_the_same_settings_only(gcs: list[FakeGcs | None], tmp_path: Path) -> None:
    assert not cluster.running_ray(_cluster(tmp_path).signature)  # nothing marked yet
    cluster.mark_ray(_cluster(tmp_path).signature)
    assert cluster.running_ray(_cluster(tmp_path).signature)
    assert not cluster.running_ray(_cluster(tmp_path, haproxy=False).signature)  # another ingress
    other_dir = RayCluster(Ingress(), tmp_path, tmp_path / "other-models")
    assert not cluster.running_ray(other_dir.signature)
    with_cpus = RayCluster(Ingress(), tmp_path, tmp_path / "models", ("--num-cpus=2",))
    assert not cluster.running_ray(with_cpus.signature)


def test_a_marked_ray_that_was_stopped_or_replaced_is_not_reused(gcs: list[FakeGcs | None], tmp_path: Path) -> None:
    signature = _cluster(tmp_path).signature
    cluster.mark_ray(signature)
    gcs[0] = FakeGcs(4242, 1700000999.0)  # same pid, another process: Ray was restarted
    assert not cluster.running_ray(signature)
    gcs[0] = None  # stopped
    assert not cluster.running_ray(signature)


def test_only_clusters_that_may_be_kept_are_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from benchmarks.chaos import MultiNodeCluster

    monkeypatch.delenv(cluster.REUSE_ENV, raising=False)
    assert not _cluster(tmp_path)._kept()
    monkeypatch.setenv(cluster.REUSE_ENV, "1")
    kept = _cluster(tmp_path)
    assert kept._kept() and kept.env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "0"
    assert not MultiNodeCluster(tmp_path, tmp_path, 1, 1)._kept()  # its scenario kills a node
