"""A Ray kept from one benchmark cluster to the next, for CI's smoke runs (`REUSE_ENV`).

A marker file says what the running Ray was started with and which GCS process is it, so a
cluster only runs on a Ray that it would have started itself, and never on one that was
stopped or restarted since. `benchmarks.cluster.RayCluster` does the starting and deploying.
"""

from __future__ import annotations

import contextlib
import json
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

# "1": a cluster's Ray outlives it (its apps are deleted, Ray and Serve's controller are left
# running, also after the benchmark ends); the next cluster with the same settings (ingress,
# `ray start` flags, model dir) runs on it, and on the same controller where its config asks
# for the same Serve-wide options (ports, gRPC, proxy location). For CI's smoke runs, where
# starting Ray and Serve is most of a scenario's time; measurements take a fresh Ray.
REUSE_ENV = "BENCH_REUSE_RAY"
REUSE_MARKER = Path(tempfile.gettempdir()) / "bench-reused-ray.json"
# What a marker holds beside the signature and the GCS: the Serve-wide options the kept Serve runs
# with (`serve`), the process deleting the last cluster's apps (`deleting`: pid, start time), and
# the one connected and waiting to delete the running cluster's apps when signalled (`armed`).
MARKER_STATE = ("serve", "deleting", "armed")


def gcs_process() -> psutil.Process | None:
    """The running GCS server, if any (a zombie is not running)."""
    for p in psutil.process_iter(["name", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and "gcs_server" in (p.info["name"] or ""):
            return p
    return None


def mark_ray(signature: dict[str, Any]) -> None:
    """Remember what the running Ray was started with, and which GCS process is it."""
    gcs = gcs_process()
    if gcs is not None:
        REUSE_MARKER.write_text(json.dumps({**signature, "gcs": [gcs.pid, gcs.create_time()]}))


def update_marker(**state: Any) -> None:
    """Set (None: drop) MARKER_STATE fields of the marker, if there is one."""
    marked = read_marker()
    if marked:
        marked.update(state)
        REUSE_MARKER.write_text(json.dumps({k: v for k, v in marked.items() if v is not None}))


def read_marker() -> dict[str, Any]:
    try:
        marked: dict[str, Any] = json.loads(REUSE_MARKER.read_text())
    except (OSError, ValueError):
        return {}
    return marked


def running_ray(signature: dict[str, Any]) -> bool:
    """Whether the Ray running here was started by a cluster with these settings and still runs."""
    marked = read_marker()
    for field in MARKER_STATE:
        marked.pop(field, None)
    gcs = gcs_process()
    alive = gcs is not None and marked.pop("gcs", None) == [gcs.pid, gcs.create_time()]
    return alive and marked == signature


def forget_ray() -> None:
    """Before the kept Ray is stopped: no marker, and no app deletion under way or waiting (it
    would only wait for the Ray that is about to go)."""
    marked = read_marker()
    for field in ("deleting", "armed"):
        signal_process(marked.get(field), signal.SIGKILL)
    REUSE_MARKER.unlink(missing_ok=True)


def signal_process(marked: list[float] | None, sig: int) -> bool:
    """Send `sig` to the process marked as [pid, start time] if it still runs (a zombie does
    not); returns whether it did."""
    if marked is None:
        return False
    with contextlib.suppress(psutil.Error):
        p = psutil.Process(int(marked[0]))
        if p.create_time() == marked[1] and p.status() != psutil.STATUS_ZOMBIE:
            p.send_signal(sig)
            return True
    return False


def wait_for_process(marked: list[float] | None, timeout_s: float) -> float:
    """Wait until the process marked as [pid, start time] has ended (a zombie has); returns
    seconds waited."""
    started = time.perf_counter()
    if marked is None:
        return 0.0
    with contextlib.suppress(psutil.Error):
        p = psutil.Process(int(marked[0]))
        while p.create_time() == marked[1] and p.status() != psutil.STATUS_ZOMBIE:
            if time.perf_counter() - started > timeout_s:
                break
            time.sleep(0.1)
    return time.perf_counter() - started
