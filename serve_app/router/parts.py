"""The parts one router replica is made of, wired once; the endpoints reach them per request."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from serve_app.cache.tiered import ResponseCache
from serve_app.config import AppArgs
from serve_app.contract import Priority
from serve_app.manifest import Manifest
from serve_app.process.gcwatch import GcPauses
from serve_app.router.admission.callers import Callers, build_registry
from serve_app.router.admission.protect import RouterGate
from serve_app.router.background import BackgroundLoops
from serve_app.router.edge.checks import InflightBytes
from serve_app.router.routing.answer_ids import AnswerIds
from serve_app.router.routing.cascade import Cascade, CascadePolicy, route_policy
from serve_app.router.routing.catalog import ModelCatalog, RecentAnswers
from serve_app.router.routing.dispatchers import DispatcherPool, SenderFor
from serve_app.router.routing.members import PoolMembers
from serve_app.router.routing.replicas import DeploymentStates
from serve_app.router.routing.repository import SharedRepository
from serve_app.router.routing.versions import VersionedModels
from serve_app.scheduling.dispatcher import standing_s
from serve_app.scheduling.protection.breaker import CircuitBreaker
from serve_app.scheduling.protection.concurrency import ClassConcurrency
from serve_app.scheduling.protection.degrade import Degrading
from serve_app.scheduling.protection.overload import ClassShedding, LoopLag
from serve_app.scheduling.traffic import TrafficPolicy


@dataclass
class RouterParts:
    args: AppArgs
    handles: dict[str, Any]  # deployment name (a model's version) -> its handle
    router_id: str
    callers: Callers
    catalog: ModelCatalog
    dispatchers: DispatcherPool
    cascades: dict[str, Cascade]  # route name -> its tiers
    loops: BackgroundLoops
    gc_pauses: GcPauses
    versions: VersionedModels  # which version answers, outcomes per version, shadows
    cache: ResponseCache
    answer_ids: AnswerIds  # what besides the request decides each deployment's answers (cache keys)
    # Request bytes this router holds, over HTTP bodies and gRPC messages alike (limits.max_inflight_bytes).
    inflight_bytes: InflightBytes
    # The router's own overload control: its event loop's lateness, the share of each class refused
    # while that delay stands above its target, the in-flight ceiling per class (HTTP and gRPC alike).
    loop_lag: LoopLag | None = None
    gate: RouterGate | None = None
    # Generation skips the dispatcher (the replica's decode loop admits), so each generator
    # has its own breaker here; classifiers' are their dispatchers'.
    breakers: dict[str, CircuitBreaker] = field(default_factory=dict)
    generator_stats: RecentAnswers = field(default_factory=RecentAnswers)  # what /router/status shows of them
    # The application's unloaded models, shared by its routers (repository.py); None: this router's alone.
    repository: SharedRepository | None = None
    # Models added to a multiplexed pool at run time (members.py).
    members: PoolMembers | None = None


def build_parts(
    args: AppArgs,
    handles: dict[str, Any],
    router_id: str,
    send_for: SenderFor,
    router_count: Callable[[], Awaitable[int]] | None = None,
    states: DeploymentStates | None = None,
    share_rollbacks: Callable[[TrafficPolicy], Awaitable[object]] | None = None,
    repository: SharedRepository | None = None,
    pool_handles: dict[str, Any] | None = None,
) -> RouterParts:
    """Wire a router's parts from its config; starts nothing (see BackgroundLoops.start)."""
    dispatchers = DispatcherPool(args, send_for)
    loop_lag, shedding = _overload(args)
    versions = VersionedModels(args, dispatchers.submit, client_work=dispatchers.busy)
    cache = ResponseCache.from_config(args.cache)
    callers = Callers(
        build_registry(args.tenants, args.scheduling.anonymous_max_priority), Priority.parse(args.scheduling.default_priority)
    )
    catalog = _catalog(args, handles, states, repository)
    parts = RouterParts(
        args=args,
        handles=handles,
        router_id=router_id,
        callers=callers,
        catalog=catalog,
        dispatchers=dispatchers,
        cascades={},
        loops=BackgroundLoops(
            dispatchers,
            {},
            args.scheduling.advanced.router_full_gc_max_interval_s,
            router_count=router_count,
            on_router_count=callers.tenants.set_share,
            loop_lag=loop_lag,
            on_lag=shedding.observe if shedding is not None else None,
            versions=versions,
            cache=cache,
            share_rollbacks=share_rollbacks,
            follow_repository=repository.follow if repository is not None else None,
        ),
        gc_pauses=GcPauses(),
        versions=versions,
        cache=cache,
        answer_ids=AnswerIds(args, catalog.manifest_at_hand),
        inflight_bytes=InflightBytes(args.limits.max_inflight_bytes),
        loop_lag=loop_lag,
        gate=_gate(args, callers, shedding),
        breakers=_generator_breakers(args),
        repository=repository,
        members=PoolMembers(args, handles, pool_handles or {}, versions.policy.first_versions),
    )
    if repository is not None and parts.members is not None:
        repository.on_added = parts.members.adopt
    parts.cascades.update(_cascades(args, versions, dispatchers))
    parts.loops.cascades = parts.cascades
    return parts


def _catalog(
    args: AppArgs, handles: dict[str, Any], states: DeploymentStates | None, repository: SharedRepository | None
) -> ModelCatalog:
    """The catalog, its manifests read from the models' replicas, following the repository's unloads."""

    async def fetch_metadata(model: str) -> dict[str, Any]:
        meta: dict[str, Any] = await handles[model].metadata.remote()
        return meta

    catalog = ModelCatalog(args, fetch_metadata, states)
    if repository is not None:
        repository.on_change = catalog.set_unloaded
    return catalog


def _generator_breakers(args: AppArgs) -> dict[str, CircuitBreaker]:
    """Generation skips the dispatcher, so each generator's breaker is the router's own."""
    return {
        g: CircuitBreaker(args.scheduling.breaker_failures, args.scheduling.breaker_open_s)
        for g in ModelCatalog.generator_names(args)
    }


def _cascades(args: AppArgs, versions: VersionedModels, dispatchers: DispatcherPool) -> dict[str, Cascade]:
    """Each route's cascade, its threshold read from its light model's manifest."""

    def standing(deployment: str) -> float:
        dispatcher = dispatchers.existing(deployment)
        return standing_s(dispatcher) if dispatcher is not None else 0.0

    cascades = {}
    for name, route in args.routes.items():
        if route.light in args.unavailable and route.threshold is None:
            # Its light tier cannot load, nor its calibration be read: every item goes to the heavy
            # tier (the light one refuses with its reason, and the cascade answers degraded).
            policy = CascadePolicy(1.0, route.signal)
        else:
            policy = route_policy(name, route, Manifest.load(args.model_path(route.light)))
        degrade = route.degrade
        target_ms = degrade.delay_target_ms or args.scheduling.advanced.queue_delay_target_ms / 2
        degrading = Degrading((Priority.parse(p) for p in degrade.priorities), target_ms / 1e3)
        wait_s = degrade.heavy_wait_ms / 1e3 if degrade.heavy_wait_ms is not None else None
        cascades[name] = Cascade(name, route.light, route.heavy, policy, versions.submit, degrading, standing, wait_s)
    return cascades


def _overload(args: AppArgs) -> tuple[LoopLag | None, ClassShedding | None]:
    """The router's own overload control when configured: its loop's lateness, and the shedding
    that follows the standing part of it."""
    target_ms = args.scheduling.advanced.router_delay_target_ms
    if target_ms is None:
        return None, None
    return LoopLag(), ClassShedding(target_ms / 1e3)


def _gate(args: AppArgs, callers: Callers, shedding: ClassShedding | None) -> RouterGate | None:
    limit = args.scheduling.advanced.router_max_inflight
    if shedding is None and limit is None:
        return None
    return RouterGate(callers, shedding, ClassConcurrency(limit) if limit is not None else None)


async def router_parts(request: Request) -> RouterParts:
    """The endpoints' dependency. `async` on purpose: FastAPI runs a plain `def` dependency in
    a worker thread, one hop per request, and anyio's hop walks every task on the loop."""
    parts: RouterParts = request.app.state.parts
    return parts


def router_capacity(args: AppArgs) -> int:
    """Requests one router replica may hold: everything its queues can admit, plus headroom.

    Below that, a flood that admission accepts fills the replica and the proxy queues the
    rest in arrival order, in front of the router's priority queues: high-priority requests
    then wait behind low ones (seen under the flood of `python -m benchmarks priority`, whose
    runs are in benchmarks/results/priority/). Memory stays bounded: queues are capped in
    rows per model.
    """
    return len(args.served) * args.scheduling.max_queue_items + ROUTER_HEADROOM


ROUTER_HEADROOM = 256  # requests in flight to models, generations, status and health calls
