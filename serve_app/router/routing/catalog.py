"""What the router serves: the names it knows (models and routes), each model's manifest as
its replicas report it, and its metadata on the wire (inputs/outputs as its family's codec says, Triton config)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from serve_app.config import AppArgs, pool_deployment
from serve_app.errors import UNAVAILABLE_RETRY_S, NotFound, Unavailable, cannot_load
from serve_app.families import family
from serve_app.manifest import Manifest
from serve_app.process.gcwatch import freeze_startup_heap
from serve_app.protocols.v2 import ModelMetadata, TensorMetadata
from serve_app.router.endpoints.codecs import codec_of
from serve_app.router.routing.replicas import DeploymentStates

logger = logging.getLogger("ray.serve")
READY_TIMEOUT_S = 5.0
READY_TTL_S = 1.0  # how long a readiness answer is reused
STATS_TTL_S = 1.0  # how long /router/status reuses a generator's stats
# A model's replica metadata: {"manifest": ..., "batching": ...} (serve_app.models.base.OnnxModel.metadata)
FetchMetadata = Callable[[str], Awaitable[dict[str, Any]]]

ROUTE_VERSION = "1"


def served_io(manifest: Manifest) -> tuple[list[TensorMetadata], list[TensorMetadata]]:
    """The tensors clients send and get, as the model's family says (its codec, serve_app.families)."""
    return codec_of(family(manifest.family)).served_io(manifest)


def model_metadata(
    name: str, manifest: Manifest, platform: str = "onnxruntime_onnx", versions: list[str] | None = None
) -> ModelMetadata:
    inputs, outputs = served_io(manifest)
    return ModelMetadata(name=name, versions=versions or [manifest.version], platform=platform, inputs=inputs, outputs=outputs)


def triton_config(name: str, manifest: Manifest, max_batch_size: int, platform: str = "onnxruntime_onnx") -> dict[str, Any]:
    """Triton's model config subset that its client tools read; dims exclude the batch axis."""
    inputs, outputs = served_io(manifest)

    def dims(t: TensorMetadata) -> dict[str, Any]:
        return {
            "name": t.name,
            "data_type": f"TYPE_{'STRING' if t.datatype == 'BYTES' else t.datatype}",
            "dims": t.shape[1:] or [1],
        }

    return {
        "name": name,
        "platform": platform,
        "backend": "onnxruntime",
        "max_batch_size": max_batch_size,
        "input": [dims(t) for t in inputs],
        "output": [dims(t) for t in outputs],
    }


class ModelCatalog:
    """The models and routes of one application, and each deployment's manifest, read once.
    A model's versions are deployments of their own; a route has one version, "1".

    `states`, when given, says which deployments Serve holds at zero replicas: those are ready
    without asking a replica, since asking would start one (`min_replicas: 0`)."""

    def __init__(
        self,
        args: AppArgs,
        fetch: FetchMetadata,
        states: DeploymentStates | None = None,
        ready_ttl_s: float = READY_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.args = args
        self.fetch = fetch
        self.states = states
        self.ready_ttl_s = ready_ttl_s
        self.clock = clock
        # Each model's last readiness answer, and the check in flight: probes in a burst (or a
        # flood of them, the endpoint needs no key) ask each model at most once per `ready_ttl_s`.
        self._ready: dict[str, tuple[float, bool]] = {}
        self._checking: dict[str, asyncio.Future[bool]] = {}
        self.manifests: dict[str, Manifest] = {}
        self.batching: dict[str, dict[str, Any]] = {}
        self._answered: set[str] = set()  # deployments a replica has answered for
        # Models an operator unloaded (the repository extension, repository.py): refused, not ready.
        self.unloaded: frozenset[str] = frozenset()

    @property
    def models(self) -> list[str]:
        """Every deployment: each version of each model."""
        return list(self.args.served)

    def generators(self) -> list[str]:
        return self.generator_names(self.args)

    @staticmethod
    def generator_names(args: AppArgs) -> list[str]:
        return [d for d in args.served if args.family_of(d).generates]

    def is_known(self, name: str) -> bool:
        return name in self.args.models or name in self.args.routes

    def known(self, name: str) -> None:
        """Raise 404 for a name that is neither a model nor a route."""
        if not self.is_known(name):
            raise NotFound(f"unknown model {name!r}; available: {sorted([*self.args.models, *self.args.routes])}")

    def answering_model(self, name: str) -> str:
        """The model whose metadata a name shows: itself, or a route's light tier."""
        return self.args.routes[name].light if name in self.args.routes else name

    def members(self, name: str) -> list[str]:
        """The models behind a name: a route's two tiers, or the model itself."""
        route = self.args.routes.get(name)
        return [route.light, route.heavy] if route is not None else [name]

    def platform(self, name: str) -> str:
        return "ensemble" if name in self.args.routes else "onnxruntime_onnx"

    def unloaded_models(self) -> frozenset[str]:
        """The models (not their versions' deployments) that stand unloaded."""
        return frozenset(self.args.served[d].model for d in self.unloaded)

    def set_unloaded(self, models: frozenset[str]) -> None:
        """The models an operator unloaded now (every version of each); readiness is asked afresh."""
        unloaded = frozenset(d for m in models if m in self.args.models for d in self.args.versions(m).values())
        for changed in unloaded ^ self.unloaded:
            self._ready.pop(changed, None)
        self.unloaded = unloaded

    def available(self, model: str) -> None:
        """Raises the 503 (with the reason, and Retry-After) of a deployment whose model cannot
        load, here rather than in its stand-in replica: one line in the log at start, not a stack
        trace per request."""
        if (reason := self.args.unavailable.get(model)) is not None:
            raise cannot_load(model, reason)
        if model in self.unloaded:
            raise Unavailable(
                f"model {model} is unloaded; an operator loads it with POST /v2/repository/models/{model}/load",
                retry_after_s=UNAVAILABLE_RETRY_S,
            )

    async def manifest(self, model: str) -> Manifest:
        """The model's manifest, read the first time and kept (it never changes): from its model
        directory when this node has it, so that a model at zero replicas is not woken for it,
        else from a replica."""
        self.available(model)
        if model not in self.manifests:
            on_disk = self._from_disk(model)
            self._remember(model, on_disk or await self.fetch(model), answered=on_disk is None)
        return self.manifests[model]

    def manifest_at_hand(self, model: str) -> Manifest | None:
        """The manifest if kept or in this node's model directory; None rather than ask (and so
        perhaps wake) a replica."""
        if model not in self.manifests and (on_disk := self._from_disk(model)) is not None:
            self._remember(model, on_disk, answered=False)
        return self.manifests.get(model)

    def _from_disk(self, model: str) -> dict[str, Any] | None:
        """What a replica's `metadata` would say before any live tuning: its manifest file and
        its configured batching. None when the directory is not on this node."""
        try:
            manifest = Manifest.load(self.args.model_path(model))
        except (OSError, ValueError):
            return None
        batching = self.args.deployment_config(model).batching.model_dump()
        return {"manifest": manifest.model_dump(mode="json"), "batching": batching}

    def _remember(self, model: str, meta: dict[str, Any], answered: bool = True) -> None:
        self.manifests[model] = Manifest.model_validate(meta["manifest"])
        self.batching[model] = meta["batching"]
        first = answered and model not in self._answered
        if answered:
            self._answered.add(model)
        # Only once every model's replica has answered: an app with a model held at zero
        # replicas never freezes its startup heap (a one-time saving, not a correctness matter).
        if first and self._answered >= set(self.serving()):
            # Every model has answered once (readiness, before traffic as a rule): the
            # handles' routing state is built, and lives as long as the router. Once.
            logger.info("router: %d objects frozen out of garbage collection", freeze_startup_heap())

    def versions(self, name: str) -> list[str]:
        return list(self.args.versions(name)) if name in self.args.models else [ROUTE_VERSION]

    def deployment(self, name: str, version: str | None) -> str:
        """The deployment whose metadata a name (and version) shows: a route shows its light tier's
        (its heavy tier's while the light one cannot load)."""
        if name in self.args.routes:
            if version not in (None, ROUTE_VERSION):
                raise NotFound(f"route {name!r} has no version {version!r}; available: [{ROUTE_VERSION!r}]")
            route = self.args.routes[name]
            # A light tier that cannot load leaves the route to its heavy tier, whose inputs it shows.
            return route.heavy if route.light in self.args.unavailable else route.light
        versions = self.args.versions(name)
        if version is None:
            return versions[self.args.models[name].version]
        if version not in versions:
            raise NotFound(f"model {name!r} has no version {version!r}; available: {sorted(versions)}")
        return versions[version]

    async def is_ready(self, model: str) -> bool:
        """Whether a replica of the model answers now: asked every time, never from the cache,
        so readiness falls when the model's replicas are gone (answers are reused for
        `ready_ttl_s`, and one check serves the probes that arrive while it runs). A model Serve holds at zero
        replicas on purpose is ready: its requests wait in the router while one starts."""
        when, ready = self._ready.get(model, (None, False))
        if when is not None and self.clock() - when < self.ready_ttl_s:
            return ready
        if model not in self._checking:
            check = self._checking[model] = asyncio.ensure_future(self._check(model))
            check.add_done_callback(lambda done: self._checking.pop(model, None) if self._checking.get(model) is done else None)
        return await asyncio.shield(self._checking[model])

    async def _check(self, model: str) -> bool:
        ready = await self._ask(model)
        self._ready[model] = (self.clock(), ready)
        return ready

    async def _ask(self, model: str) -> bool:
        if model in self.args.unavailable or model in self.unloaded:  # not until deployed or loaded again
            return False
        pool = self.args.served[model].config.pool
        if pool is not None and self.states is not None:
            # A pool's model is ready while its pool takes requests: asking a replica would load it
            # there, and a probe of every model would load them all in turn.
            return await self.states.takes_requests(pool_deployment(pool))
        if self.states is not None and await self.states.scaled_to_zero(model):
            return True
        try:
            meta = await asyncio.wait_for(self.fetch(model), READY_TIMEOUT_S)
        except Exception:  # any failure to answer means not ready
            return False
        self._remember(model, meta)
        return True

    async def all_ready(self, models: list[str]) -> bool:
        return all(await asyncio.gather(*(self.is_ready(m) for m in models)))

    def serving(self) -> list[str]:
        """The deployments server readiness waits for: all but those whose model cannot load (their
        requests get 503 with the reason): one broken model directory must not take the router
        out of a load balancer's service."""
        return [m for m in self.models if m not in self.args.unavailable]


class RecentAnswers:
    """Each generator's last stats answer, reused for `ttl_s`: a burst of status calls asks each
    generator at most once per `ttl_s` instead of once per call (the fan-out is the cost)."""

    def __init__(self, ttl_s: float = STATS_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._answers: dict[str, tuple[float, dict[str, Any] | None]] = {}

    async def get(self, name: str, ask: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any] | None:
        when, answer = self._answers.get(name, (None, None))
        if when is not None and self.clock() - when < self.ttl_s:
            return answer
        self._answers[name] = (self.clock(), answer)  # calls meanwhile reuse the last answer rather than ask again
        try:
            fresh: dict[str, Any] | None = await asyncio.wait_for(ask(), READY_TIMEOUT_S)
        except Exception:  # status must answer even when a generator does not
            fresh = None
        self._answers[name] = (self.clock(), fresh)
        return fresh
