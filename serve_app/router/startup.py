"""Process setup for a router replica, in one place: run once, from the router's startup hook."""

from __future__ import annotations

import logging

from serve_app.config import SchedulingConfig
from serve_app.process.cpu_priority import renice_process
from serve_app.process.gcwatch import GcPauses, freeze_startup_heap
from serve_app.scheduling.queue import QUEUES

logger = logging.getLogger("ray.serve")


def prepare_process(scheduling: SchedulingConfig, gc_pauses: GcPauses, open_to_all: bool) -> None:
    """Watch GC pauses, set the router's CPU priority, say what is unsafe, and freeze the startup heap."""
    gc_pauses.install()
    if scheduling.router_nice is not None:
        renice_process(scheduling.router_nice)
    if open_to_all:
        logger.warning("no API keys configured: this server is OPEN to every caller (set `tenants` in the config)")
    if not QUEUES[scheduling.policy].prioritized:
        logger.warning("router scheduling policy is fifo: no priorities, deadlines or shedding (a benchmark baseline)")
    logger.info("router: %d startup objects frozen out of garbage collection", freeze_startup_heap())
