"""A Ray kept from one benchmark cluster to the next, for CI's smoke runs (`REUSE_ENV`).

A marker file says what the running Ray was started with and which GCS process is it, so a
cluster only runs on a Ray that it would have started itself, and never on one that was
stopped or restarted since. Between two clusters the kept Serve's apps are deleted, and Serve is
shut down where the next config asks for other Serve-wide options. `benchmarks.cluster.RayCluster`
does the starting and deploying.
"""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil

from benchmarks import procs

# "1": a cluster's Ray outlives it (its apps are deleted, Ray and Serve's controller are left
# running, also after the benchmark ends); the next cluster with the same settings (ingress,
# `ray start` flags, model dir) runs on it, and on the same controller where the Serve-wide
# options it runs with (ports, gRPC, proxy location) serve the config (`serves`). For CI's
# smoke runs, where starting Ray and Serve is most of a scenario's time; measurements take a
# fresh Ray.
REUSE_ENV = "BENCH_REUSE_RAY"
REUSE_MARKER = Path(tempfile.gettempdir()) / "bench-reused-ray.json"
# What a marker holds beside the signature and the GCS: the Serve-wide options the kept Serve runs
# with (`serve`), the process deleting the last cluster's apps (`deleting`: pid, start time), and
# the one connected and waiting to delete the running cluster's apps when signalled (`armed`).
MARKER_STATE = ("serve", "deleting", "armed")


def gcs_process() -> psutil.Process | None:
    """The running GCS server, if any."""
    return next(iter(procs.named(["gcs_server"])), None)


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
        procs.signal_marked(marked.get(field), signal.SIGKILL)
    REUSE_MARKER.unlink(missing_ok=True)


# -- the kept Serve between clusters: its last apps deleted, its Serve-wide options ------------

DELETE_APPS = "[serve.delete(name) for name in serve.status().applications]"


def quick_to_delete(config: dict[str, Any]) -> dict[str, Any]:
    """The config with each listed deployment's replicas stopping as soon as they are idle. A
    stopping replica sleeps `graceful_shutdown_wait_loop_s` (2 s by default) before it first looks
    for requests in flight; a kept Ray's apps are deleted with none, and the next deploy waits."""
    config = copy.deepcopy(config)
    for app in config.get("applications", []):
        for deployment in app.get("deployments", []):
            deployment.setdefault("graceful_shutdown_wait_loop_s", 0.1)
    return config


def arm_deleter(env: dict[str, str], connect: str) -> None:
    """After a deploy: a process that imports Ray and connects (`connect`: the Python that does)
    now, while the benchmark runs, then waits for SIGUSR1 to delete the apps. The cluster's end
    then costs the deletion alone. One is enough: it deletes whatever apps run when signalled."""
    if procs.marked_process(read_marker().get("armed")) is not None:
        return
    # SIGUSR1 is blocked before anything else: sent early, it waits for `sigwait` instead of
    # ending the process.
    block = "import signal; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})"
    update_marker(armed=_spawn(f"{block}; {connect}; signal.sigwait({{signal.SIGUSR1}}); {DELETE_APPS}", env))


def delete_apps_behind(env: dict[str, str], connect: str) -> None:
    """At a cluster's end: every app deleted from the kept Serve, by the armed process (or a new
    one), which the cluster does not wait for: the next deploy does (`settle_serve`), and meanwhile
    the benchmark writes its results and the next one starts."""
    armed = read_marker().get("armed")
    if procs.signal_marked(armed, signal.SIGUSR1):
        update_marker(deleting=armed, armed=None)
    else:
        update_marker(deleting=_spawn(f"{connect}; {DELETE_APPS}", env), armed=None)


def settle_serve(env: dict[str, str], connect: str, options: dict[str, Any]) -> float:
    """Before a deploy: the last cluster's apps are gone, and a Serve that cannot serve the Serve-wide
    `options` is shut down, since a deploy onto it would keep its own (its ports, its gRPC
    servicers). Returns the seconds waited for the deletion."""
    marked = read_marker()
    waited = procs.wait_marked(marked.get("deleting"), timeout_s=120)
    running = marked.get("serve")
    if running is not None and not serves(running, options):
        subprocess.run([sys.executable, "-c", f"{connect}; serve.shutdown()"], env=env, capture_output=True, timeout=120)
        running = None
    update_marker(serve=options if running is None else running, deleting=None)
    return waited


def serves(running: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether a Serve started with the Serve-wide options `running` serves a config that asks for
    `wanted`: the same options, or a gRPC proxy that a config without gRPC leaves idle."""
    if "grpc_options" not in wanted:
        running = {k: v for k, v in running.items() if k != "grpc_options"}
    return running == wanted


def _spawn(code: str, env: dict[str, str]) -> procs.Marked:
    """`python -c code`, detached; returns it marked as [pid, start time]."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    return [proc.pid, psutil.Process(proc.pid).create_time()]
