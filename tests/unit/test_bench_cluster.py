"""A kept Ray (benchmarks.kept.REUSE_ENV) is reused only by a cluster with its settings, and
only while the GCS that was marked still runs. No Ray here: the GCS process is a stand-in."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from benchmarks import cluster, kept, procs
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
    monkeypatch.setattr(kept, "gcs_process", lambda: running[0])
    monkeypatch.setattr(kept, "REUSE_MARKER", tmp_path / "marker.json")
    return running


def _cluster(tmp_path: Path, haproxy: bool = True) -> RayCluster:
    return RayCluster(Ingress(haproxy=haproxy), tmp_path, tmp_path / "models")


def test_a_marked_ray_is_found_by_the_same_settings_only(gcs: list[FakeGcs | None], tmp_path: Path) -> None:
    assert not kept.running_ray(_cluster(tmp_path).signature)  # nothing marked yet
    kept.mark_ray(_cluster(tmp_path).signature)
    assert kept.running_ray(_cluster(tmp_path).signature)
    assert not kept.running_ray(_cluster(tmp_path, haproxy=False).signature)  # another ingress
    other_dir = RayCluster(Ingress(), tmp_path, tmp_path / "other-models")
    assert not kept.running_ray(other_dir.signature)
    with_cpus = RayCluster(Ingress(), tmp_path, tmp_path / "models", ("--num-cpus=2",))
    assert not kept.running_ray(with_cpus.signature)


def test_a_marked_ray_that_was_stopped_or_replaced_is_not_reused(gcs: list[FakeGcs | None], tmp_path: Path) -> None:
    signature = _cluster(tmp_path).signature
    kept.mark_ray(signature)
    gcs[0] = FakeGcs(4242, 1700000999.0)  # same pid, another process: Ray was restarted
    assert not kept.running_ray(signature)
    gcs[0] = None  # stopped
    assert not kept.running_ray(signature)


def test_only_clusters_that_may_be_kept_are_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from benchmarks.chaos import MultiNodeCluster

    monkeypatch.delenv(kept.REUSE_ENV, raising=False)
    assert not _cluster(tmp_path)._kept()
    monkeypatch.setenv(kept.REUSE_ENV, "1")
    reused = _cluster(tmp_path)
    assert reused._kept() and reused.env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "0"
    assert not MultiNodeCluster(tmp_path, tmp_path, 1, 1)._kept()  # its scenario kills a node


def test_a_kept_serve_is_shut_down_only_for_serve_wide_options_it_cannot_serve(
    gcs: list[FakeGcs | None], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ran: list[str] = []
    monkeypatch.setattr(kept.subprocess, "run", lambda cmd, **kw: ran.append(cmd[-1]))
    reused = _cluster(tmp_path)
    kept.mark_ray(reused.signature)  # a fresh Ray: no Serve yet
    ours = {"proxy_location": "HeadOnly", "grpc_options": {"port": 9000}}
    reused._settle_serve(ours)
    reused._settle_serve(ours)  # the next config on the same Serve
    assert ran == [] and kept.running_ray(reused.signature)
    reused._settle_serve({"proxy_location": "HeadOnly"})  # no gRPC asked: the running proxy's stays idle
    assert ran == []
    reused._settle_serve({"proxy_location": "HeadOnly", "grpc_options": {"port": 9001}})  # other servicers
    assert len(ran) == 1 and ran[0].endswith("serve.shutdown()") and kept.running_ray(reused.signature)
    reused._settle_serve({"proxy_location": "EveryNode", "grpc_options": {"port": 9001}})
    assert len(ran) == 2
    reused._settle_serve({"proxy_location": "EveryNode", "grpc_options": {"port": 9001}})
    assert len(ran) == 2  # the marker holds the new Serve's options
    # A Serve without gRPC cannot serve a config that asks for it.
    assert not kept.serves({"proxy_location": "HeadOnly"}, ours) and kept.serves(ours, {"proxy_location": "HeadOnly"})


def test_a_deploy_on_a_kept_serve_waits_for_the_last_apps_deletion(
    gcs: list[FakeGcs | None], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    reused = _cluster(tmp_path)
    kept.mark_ray(reused.signature)
    deleting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    kept.update_marker(deleting=[deleting.pid, psutil.Process(deleting.pid).create_time()])
    assert kept.running_ray(reused.signature)  # the deletion is state, not part of the settings
    reused._settle_serve({})
    assert deleting.poll() is not None and "deleting" not in kept.read_marker()
    # A marked process that is long gone (or a new one with its pid) is not waited for.
    assert procs.wait_marked([deleting.pid, 1.0], timeout_s=5) < 1


def test_stopping_a_kept_ray_ends_a_deletion_under_way_or_waiting(
    gcs: list[FakeGcs | None], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # stop_ray's own killing and waiting would reach any Ray on this machine: only its first step runs.
    monkeypatch.setattr(cluster.subprocess, "run", lambda *a, **kw: None)
    monkeypatch.setattr(cluster, "kill_orphan_haproxy", lambda: None)
    monkeypatch.setattr(cluster, "wait_for_ray_exit", lambda: None)
    reused = _cluster(tmp_path)
    kept.mark_ray(reused.signature)
    deleting, armed = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2))
    kept.update_marker(deleting=_marked(deleting), armed=_marked(armed))
    reused._stop()
    assert deleting.wait(timeout=10) != 0 and armed.wait(timeout=10) != 0 and not kept.read_marker()


def _marked(proc: subprocess.Popen) -> list[float]:
    return [proc.pid, psutil.Process(proc.pid).create_time()]


def test_the_deleter_armed_at_deploy_deletes_the_apps_when_the_cluster_ends(
    gcs: list[FakeGcs | None], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The real signalling, with a stand-in for Ray: the armed process connects (here: says it is
    ready) and deletes (here: writes a file) only once the cluster ends."""
    ready, deleted = tmp_path / "ready", tmp_path / "deleted"
    monkeypatch.setattr(kept, "DELETE_APPS", f"open({str(deleted)!r}, 'w').close()")
    connect = f"open({str(ready)!r}, 'w').close()"
    kept.mark_ray(_cluster(tmp_path).signature)
    kept.arm_deleter({}, connect)
    armed = kept.read_marker()["armed"]
    kept.arm_deleter({}, connect)  # one is waiting already: no second
    assert kept.read_marker()["armed"] == armed
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline, "the armed process never started"
        time.sleep(0.05)
    assert not deleted.exists()  # armed, not fired
    kept.delete_apps_behind({}, connect)
    assert kept.read_marker().get("deleting") == armed and "armed" not in kept.read_marker()
    assert procs.wait_marked(armed, timeout_s=30) < 30 and deleted.exists()


def test_a_kept_rays_deployments_stop_without_the_default_idle_wait() -> None:
    config: dict[str, Any] = {
        "applications": [
            {"name": "default", "deployments": [{"name": "router"}, {"name": "m", "graceful_shutdown_wait_loop_s": 1}]}
        ]
    }
    quick = kept.quick_to_delete(config)
    assert [d.get("graceful_shutdown_wait_loop_s") for d in quick["applications"][0]["deployments"]] == [0.1, 1]
    assert "graceful_shutdown_wait_loop_s" not in config["applications"][0]["deployments"][0]  # a copy: the caller's is kept
