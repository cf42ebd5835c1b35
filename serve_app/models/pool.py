"""A pool of replicas that many classifier models of one family share (Serve's model multiplexing).

A config entry whose name holds `*` and that sets `multiplex` is a pool (serve_app.config): each
model directory under its `path` whose name matches is one model, served by the pool's one
deployment. A replica loads a model on the first batch it gets for it (the router names the
model in the call, as Serve's multiplexed model id) and holds at most `max_models_per_replica`,
the least recently used out first; Serve loads one model at a time per replica. Which replica
gets a model's batch is the pool's request router's choice (serve_app.router.routing.pool_router).

Each loaded model is the family's own deployment class, built as a plain object: the same
batching, lanes, health probe and metrics as a deployment of its own, without the same-node link
(a pool's batches go through Serve, where the placement happens).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import psutil
from ray import serve

from serve_app.config import in_pool, member_path
from serve_app.contract import BULK, BatchReply
from serve_app.families import family, load
from serve_app.models.classifier import Classifier
from serve_app.models.prediction import Prediction
from serve_app.process.heaptrim import HeapTrim

logger = logging.getLogger("ray.serve")


class Loaded:
    """A model as the pool's cache holds it. Serve calls `__del__` on what it evicts: the pool then
    lets go of the model too, and its memory goes at the first load after the last batch that
    still runs on it (ModelPool._build)."""

    def __init__(self, model: Classifier, evicted: Callable[[], object]) -> None:
        self.model = model
        self.evicted = evicted

    def __del__(self) -> None:
        self.evicted()


@serve.deployment(max_ongoing_requests=16)
class ModelPool:
    """The pool's replica: models loaded on demand, each answering its own batches."""

    def __init__(
        self, pool: str, sources: dict[str, str], config: dict[str, Any], max_models: int, root: str | None = None
    ) -> None:
        self.pool = pool
        self.sources = sources  # model -> its directory or object-store URI
        self.root = root  # the pool's path or prefix: where a model added since the build is (routing/members.py)
        self.config = config
        self.user_config: dict[str, Any] | None = None
        self.cls: type[Classifier] = load(family(config["family"]).deployment).func_or_class
        self.load_s: dict[str, float] = {}  # each model's last load time, for runtime_info
        self.loads: list[float] = []  # every load's seconds, in order
        self.loaded_models: list[str] = []  # the model of each of those loads
        self.batches: Counter[str] = Counter()  # per model, batches run here
        self.cold: Counter[str] = Counter()  # of those, batches that arrived with their model not loaded here
        self.instances: dict[str, Classifier] = {}  # the models loaded now, as Serve's cache holds them
        self.heap = HeapTrim()
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.resident: weakref.WeakSet[Classifier] = weakref.WeakSet()  # held, or evicted and not yet freed

        async def loaded(model: str) -> Loaded:
            instance = await asyncio.to_thread(self._build, model)
            self.instances[model] = instance
            return Loaded(instance, lambda: self._evicted(model, instance))

        # Serve's LRU of loaded models, sized per pool (the decorator takes its size when applied).
        self.model = serve.multiplexed(max_num_models_per_replica=max_models)(loaded)

    def _build(self, model: str) -> Classifier:
        source = self.sources.get(model)
        if source is None and self.root is not None and in_pool(self.pool, model):
            source = member_path(self.root, model)
        if source is None:
            raise KeyError(f"{model!r} is not a model of pool {self.pool!r}")
        # A model sits in reference cycles (its lanes hold its bound methods), so an evicted one is
        # freed by a full collection only, which a process of this size gets rarely: without this,
        # every evicted model's sessions stayed resident. Each load first collects what earlier
        # evictions left (a model still running a batch when evicted goes at the next load) and
        # hands the freed pages back to the system.
        gc.collect()
        self.heap.trim()
        started = time.perf_counter()
        instance = self.cls(model, source, self.config)  # loads, and warms up its sessions
        self.resident.add(instance)
        instance.link = None  # a pool's batches come through Serve, where placement chooses the replica
        if self.user_config is not None:
            instance.reconfigure(self.user_config)
        if delay_s := (self.user_config or {}).get("faults", {}).get("load_delay_s", 0.0):
            time.sleep(delay_s)  # a drill: a load as slow as a large model's
        self.load_s[model] = round(time.perf_counter() - started, 3)
        self.loads.append(self.load_s[model])
        self.loaded_models.append(model)
        logger.info("pool %s: loaded %s in %.2f s", self.pool, model, self.load_s[model])
        return instance

    def _evicted(self, model: str, instance: Classifier) -> None:
        """Serve evicted `instance` (or the collector found its holder): forget it, unless the model
        has been loaded again since (a holder's collection may come after that)."""
        if self.instances.get(model) is instance:
            del self.instances[model]

    async def _current(self) -> Classifier:
        loaded: Loaded = await self.model(serve.get_multiplexed_model_id())
        return loaded.model

    async def run(
        self, payloads: list[Any], router: str = "", router_queued: int = 0, lane: str = BULK,
        traces: list[str | None] | None = None,
    ) -> BatchReply:  # fmt: skip
        """One batch of the call's model (Classifier.run), loading the model first if needed."""
        model = serve.get_multiplexed_model_id()
        cold = model not in self.instances
        self.batches[model] += 1
        self.cold[model] += cold
        started = time.perf_counter()
        instance = await self._current()
        loaded = time.perf_counter()
        # No payloads: a router starting the load ahead of the model's requests (coldstart.py).
        reply = await instance.run(payloads, router, router_queued, lane, traces) if payloads else BatchReply([], 0.0, 0.0)
        if cold:  # this batch waited for the load (its own, or another batch's of the same model)
            reply.load_s = loaded - started
        reply.replica, reply.held = self.replica, tuple(self.instances)
        return reply

    async def classify(self, item: Any) -> Prediction:
        """One input for the model a `DeploymentHandle` caller names as Serve's multiplexed model id
        (`handle.options(multiplexed_model_id="reviews-en")`), batched with that model's other single
        inputs (Classifier.classify: Serve's batching keeps each batch to one model id)."""
        return await (await self._current()).classify(item)

    def stats(self) -> dict[str, Any]:
        """This replica's share of the pool: what it holds, its loads, its batches (and how many of
        them found their model loaded), its resident memory."""
        return {
            "replica": self.replica,
            "held": sorted(self.instances),
            "resident_models": len(self.resident),
            "loads_s": list(self.loads),
            "load_models": list(self.loaded_models),
            "batches": dict(self.batches),
            "cold_batches": dict(self.cold),
            "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
        }

    async def metadata(self) -> dict[str, Any]:
        return await (await self._current()).metadata()

    async def runtime_info(self) -> dict[str, Any]:
        info = await (await self._current()).runtime_info()
        return {**info, "pool": self.pool, "held": sorted(self.instances), "load_s": dict(self.load_s)}

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Batching knobs for every model of the pool: those loaded later start with them too."""
        self.user_config = user_config
        for instance in list(self.instances.values()):
            instance.reconfigure(user_config)

    async def check_health(self) -> None:
        """Unhealthy while a loaded model is (a batch stuck past its stall timeout, a failed probe)."""
        for instance in list(self.instances.values()):
            await instance.check_health()
