"""Process setup for a router replica, in one place: run once, from the router's startup hook."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from serve_app.config import SchedulingConfig
from serve_app.process.cpu_priority import renice_process
from serve_app.process.gcwatch import GcPauses, freeze_startup_heap
from serve_app.scheduling.queue import QUEUES

logger = logging.getLogger("ray.serve")

# The ingress that serves several times the requests per core of Serve's Python proxy on this app
# (benchmarks/results/ingress/). Ray reads them when it starts, from the environment of the
# processes that start it: `serve-app serve` and the KubeRay manifest set them
# (serve_app/tools/ingress_env.py); a plain `serve run`, or a cluster started with `ray start`
# without them, runs the Python proxy. Either way every request passes Serve's per-request
# handling, so status codes, bodies and Serve's request metrics are the same.
FAST_INGRESS = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}


def ingress_report(env: Mapping[str, str], direct_infer: bool) -> tuple[int, str]:
    """The line a router logs once at start: which ingress this Ray cluster runs, and on the slow
    one what to set for the fast one. `direct_infer`: the opt-in path past Serve's per-request
    wrapper (serve_app.router.edge.direct) is on."""
    unset = [name for name, value in FAST_INGRESS.items() if env.get(name) != value]
    if unset:
        return logging.WARNING, (
            f"ingress: Serve's Python proxy ({' and '.join(unset)} not set where Ray started). "
            "For HAProxy, several times faster: `serve-app serve` sets them; on a cluster started with "
            '`ray start`, run `eval "$(serve-app ingress-env)"` before `ray start` on every node'
        )
    if direct_infer:
        return logging.INFO, (
            "ingress: HAProxy, v2 infer past Serve's per-request handling (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH): "
            "its timeouts answer 504 (limits.infer_timeout_s) and Serve's request metrics leave it out"
        )
    return logging.INFO, "ingress: HAProxy, throughput-optimized"


def prepare_process(scheduling: SchedulingConfig, gc_pauses: GcPauses, open_to_all: bool) -> None:
    """Watch GC pauses, set the router's CPU priority, say what is unsafe, and freeze the startup heap."""
    gc_pauses.install()
    if scheduling.advanced.router_nice is not None:
        renice_process(scheduling.advanced.router_nice)
    if open_to_all:
        logger.warning("no API keys configured: this server is OPEN to every caller (set `tenants` in the config)")
    if not QUEUES[scheduling.policy].prioritized:
        logger.warning("router scheduling policy is fifo: no priorities, deadlines or shedding (a benchmark baseline)")
    logger.info("router: %d startup objects frozen out of garbage collection", freeze_startup_heap())
