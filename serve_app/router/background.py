"""The router's background loops, started together at startup and stopped together."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from serve_app.cache.tiered import ResponseCache
from serve_app.process.gcwatch import FullCollectionSchedule
from serve_app.process.heaptrim import HeapTrim
from serve_app.router.routing.cascade import Cascade
from serve_app.router.routing.dispatchers import DispatcherPool
from serve_app.router.routing.versions import VersionedModels
from serve_app.router.telemetry import RouterTelemetry
from serve_app.scheduling.protection.overload import LoopLag
from serve_app.scheduling.traffic import TrafficPolicy

logger = logging.getLogger("ray.serve")
GC_POLL_S = 0.25
ROUTER_COUNT_POLL_S = 5.0
LAG_TICK_S = 0.01  # how often the loop measures its own lateness
ROLLBACK_TICK_S = 1.0  # how often canaries are compared with their baselines
TRIM_EVERY_S = 10.0  # how often freed heap pages go back to the OS (heaptrim.py)
FOLLOW_REPOSITORY_S = 1.0  # how often a router asks which models stand unloaded (repository.py)


class BackgroundLoops:
    """Metrics export, and (when configured) the router's own full-collection schedule."""

    def __init__(
        self,
        dispatchers: DispatcherPool,
        cascades: dict[str, Cascade],
        full_gc_max_interval_s: float | None,
        telemetry: Callable[[], RouterTelemetry] = RouterTelemetry,
        router_count: Callable[[], Awaitable[int]] | None = None,
        on_router_count: Callable[[int], None] | None = None,
        loop_lag: LoopLag | None = None,
        on_lag: Callable[[float], None] | None = None,
        versions: VersionedModels | None = None,
        cache: ResponseCache | None = None,
        share_rollbacks: Callable[[TrafficPolicy], Awaitable[object]] | None = None,
        follow_repository: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.dispatchers = dispatchers
        self.cascades = cascades
        self.full_gc_max_interval_s = full_gc_max_interval_s
        self.make_telemetry = telemetry
        # How many router replicas there are now, and who must follow it (the rate limits' share).
        self.router_count, self.on_router_count = router_count, on_router_count
        self.loop_lag = loop_lag  # fed by its own loop when the router's overload control is on
        self.on_lag = on_lag  # told each raw lateness sample (the router's class shedding)
        self.versions, self.cache = versions, cache  # rollback checks, and their metrics
        self.share_rollbacks = share_rollbacks  # with the application's other routers (rollback_ledger.py)
        self.follow_repository = follow_repository  # the models its operators unloaded (repository.py)
        self.heap_trim = HeapTrim()
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Start every loop on the running event loop; call once, from the router's startup hook."""
        assert not self.tasks, "background loops already started"
        self._spawn(self._export_metrics())
        if self.router_count is not None and self.on_router_count is not None:
            self._spawn(self._follow_router_count(self.router_count, self.on_router_count))
        if self.loop_lag is not None:
            self._spawn(self._measure_lag(self.loop_lag, self.on_lag))
        if self.versions is not None and self.cache is not None:
            self._spawn(self._lifecycle(self.versions, self.cache))
        if self.versions is not None and self.share_rollbacks is not None:
            self._spawn(self._share_rollbacks(self.versions.policy, self.share_rollbacks))
        if self.follow_repository is not None:
            self._spawn(self._follow(self.follow_repository, FOLLOW_REPOSITORY_S, "following the model repository"))
        if self.heap_trim.available:
            self._spawn(self._trim_heap(self.heap_trim))
        if self.full_gc_max_interval_s is not None:
            self._spawn(self._collect_garbage(FullCollectionSchedule(max_interval_s=self.full_gc_max_interval_s)))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()

    def check(self) -> None:
        """Raise if a loop ended on its own (an exception): the router's health check."""
        for task in self.tasks:
            if task.done() and not task.cancelled():
                raise RuntimeError(f"router background loop ended: {task.exception()!r}")

    def _spawn(self, loop: Coroutine[Any, Any, None]) -> None:
        self.tasks.append(asyncio.get_running_loop().create_task(loop))

    def cascade_counts(self) -> Counter[tuple[str, str]]:
        return Counter({(route, outcome): n for route, c in self.cascades.items() for outcome, n in c.counts.items()})

    async def _export_metrics(self) -> None:
        telemetry = self.make_telemetry()
        while True:
            await asyncio.sleep(telemetry.interval_s)
            try:
                by_model = dict(self.dispatchers.by_model)
                breakers = {m: int(d.breaker.state) for m, d in by_model.items()}
                await telemetry.export(by_model, self.cascade_counts(), breakers)
            except Exception:  # metrics must never take the router down
                logger.exception("exporting router metrics failed")

    @staticmethod
    async def _lifecycle(versions: VersionedModels, cache: ResponseCache) -> None:
        """Canary rollbacks checked every tick; version and cache metrics exported every other."""
        from serve_app.router.telemetry_lifecycle import LifecycleTelemetry

        telemetry = LifecycleTelemetry()
        tick = 0
        while True:
            await asyncio.sleep(ROLLBACK_TICK_S)
            tick += 1
            try:
                versions.policy.check_rollbacks()
                if tick % 2 == 0:
                    await telemetry.export(versions, cache)
            except Exception:  # a rollback check or a metric must never take the router down
                logger.exception("checking rollbacks or exporting version metrics failed")

    @staticmethod
    async def _share_rollbacks(policy: TrafficPolicy, share: Callable[[TrafficPolicy], Awaitable[object]]) -> None:
        """Rollbacks sent to and adopted from the application's other routers, every tick, in a loop
        of its own: a slow ledger delays neither the checks nor the metrics."""
        while True:
            await asyncio.sleep(ROLLBACK_TICK_S)
            try:
                if policy.judges:
                    await share(policy)
            except Exception:  # advice from other routers: never a reason to stop
                logger.exception("sharing rollbacks failed")

    @staticmethod
    async def _follow(step: Callable[[], Awaitable[None]], every_s: float, what: str) -> None:
        """`step` every `every_s`; a failure is logged once per run of them and tried again."""
        failing = False
        while True:
            await asyncio.sleep(every_s)
            try:
                await step()
                failing = False
            except Exception:
                if not failing:
                    logger.exception("%s failed; retrying every %g s", what, every_s)
                failing = True

    async def _follow_router_count(self, count: Callable[[], Awaitable[int]], follow: Callable[[int], None]) -> None:
        seen = None
        while True:
            try:
                if (now := await count()) != seen:
                    follow(now)
                    seen = now
            except Exception:  # the count is advice; a failed read keeps the last share
                logger.exception("reading the router replica count failed")
            await asyncio.sleep(ROUTER_COUNT_POLL_S)

    @staticmethod
    async def _measure_lag(lag: LoopLag, on_lag: Callable[[float], None] | None = None) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(LAG_TICK_S)
            late = loop.time() - asked - LAG_TICK_S
            lag.observe(late)
            if on_lag is not None:
                on_lag(late)

    @staticmethod
    async def _trim_heap(heap: HeapTrim) -> None:
        # In a thread, so the GIL is free while glibc walks the arenas; an allocation that needs
        # the arena being trimmed waits for it.
        while True:
            await asyncio.sleep(TRIM_EVERY_S)
            await asyncio.to_thread(heap.trim)

    async def _collect_garbage(self, schedule: FullCollectionSchedule) -> None:
        threshold = gc.get_threshold()
        FullCollectionSchedule.take_over()
        try:
            while True:
                await asyncio.sleep(GC_POLL_S)
                if schedule.due(self.dispatchers.busy()):
                    gc.collect()
                    schedule.ran()
        finally:  # whatever ends this loop, Python collects on its own again
            gc.set_threshold(*threshold)
