"""One dispatcher per model, made from the config on first use; making one starts nothing."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable, Collection, Iterator
from typing import Any

from serve_app.config import AppArgs, MultiplexConfig
from serve_app.contract import BULK, BatchReply, Priority
from serve_app.errors import cannot_load
from serve_app.link.client import LinkedSender
from serve_app.process.cpu_priority import MODEL_WORK
from serve_app.scheduling.coldstart import ColdStart, ModelColdStart
from serve_app.scheduling.dispatcher import Dispatcher, DispatchSettings, RequestTiming, SendBatch
from serve_app.scheduling.protection.limit import AdaptiveLimit

logger = logging.getLogger("ray.serve")

# (model) -> how to send that model a batch (a deployment handle call, in the router)
SenderFor = Callable[[str], SendBatch]


def replica_died(error: Exception) -> bool:
    """The replica (its actor or its node) went away under the call: the work may run elsewhere.
    (A batch whose same-node link breaks goes through Serve at once, in `LinkedSender`.)"""
    from ray.exceptions import RayActorError  # ActorDiedError and ActorUnavailableError among them

    return isinstance(error, RayActorError)


def _observed(send: SendBatch, cold: ModelColdStart, limit: AdaptiveLimit | None, busy_batches: int) -> SendBatch:
    """`send`, its answers telling the pool's cold starts what each replica holds, and a pool
    model's in-flight limit kept at what keeps each holder busy (`busy_batches` each) plus the one
    batch that may go past busy holders to a second copy (serve_app.scheduling.placement): the
    limit learns from how long batches wait at the replicas, and with each holder running one
    batch and queueing one it neither grows to use a second holder nor keeps the batch that makes one."""

    async def observed(payloads: list[Any], queued: int, lane: str, traces: list[str | None] | None) -> BatchReply:
        reply = await cold.send(send, payloads, queued, lane, traces)
        if limit is not None:
            limit.hold_at_least(busy_batches * cold.pool.holders(cold.model) + 1)
        return reply

    return observed


class DispatcherPool:
    """The router's per-model queues. `send_for(model)` returns the coroutine that runs a batch."""

    def __init__(self, args: AppArgs, send_for: SenderFor, retryable: Callable[[Exception], bool] = replica_died) -> None:
        self.args = args
        self.send_for = send_for
        self.retryable = retryable
        self.by_model: dict[str, Dispatcher] = {}
        self.cold_starts: dict[str, ColdStart] = {}  # per multiplexed pool
        self.warming: set[asyncio.Task[None]] = set()  # loads started for refused requests

    def get(self, model: str) -> Dispatcher:
        if (reason := self.args.unavailable.get(model)) is not None:
            # A cascade's tier, a policy's version or a shadow whose model cannot load: the 503
            # with the reason, which a cascade answers around and a canary's rollback counts.
            raise cannot_load(model, reason)
        if model not in self.by_model:
            send = self.send_for(model)
            cold, limit = self.cold(model, send), self.limit(model)
            if cold is not None:  # what each answer says the pool holds
                send = _observed(send, cold, limit, self._busy_batches(model))
            self.by_model[model] = Dispatcher(
                model, send, dispatch_settings(self.args, model), limit=limit, retryable=self.retryable, cold=cold
            )
        return self.by_model[model]

    def cold(self, model: str, send: SendBatch) -> ModelColdStart | None:
        """A multiplexed pool's model: what its pool holds and how long a load takes, shared with
        the pool's other models (serve_app.scheduling.coldstart); its loads start with an empty batch."""
        pool = self.args.deployment_config(model).pool
        if pool is None:
            return None
        cold = ModelColdStart(model, self.cold_starts.setdefault(pool, ColdStart()), lambda: self._warm(send, cold))
        return cold

    def _warm(self, send: SendBatch, cold: ModelColdStart) -> None:
        async def load() -> None:
            try:
                await cold.send(send, [], 0, BULK, None)
            except Exception as e:  # the request that wanted it was refused already; the next one tries again
                logger.warning("loading %s ahead of its requests failed: %r", cold.model, e)

        # In a context of its own, as a batch is (Dispatcher): not tied to the refused request.
        task = asyncio.get_running_loop().create_task(load(), context=contextvars.Context())
        self.warming.add(task)
        task.add_done_callback(self.warming.discard)

    def _multiplex(self, model: str) -> MultiplexConfig | None:
        """The settings of the multiplexed pool serving `model`, if one does."""
        pool = self.args.deployment_config(model).pool
        return self.args.pools[pool].multiplex if pool is not None else None

    def _busy_batches(self, model: str) -> int:
        multiplex = self._multiplex(model)
        return multiplex.busy_batches if multiplex is not None else 1

    def limit(self, model: str) -> AdaptiveLimit | None:
        """A multiplexed pool's model may start with one batch more in flight than its pool calls a
        replica busy: only a batch sent while every holder is busy can go to a second replica
        (serve_app.scheduling.placement), and the learned limit, which counts one replica until
        then, would otherwise never send it. Other models: the dispatcher's default."""
        multiplex = self._multiplex(model)
        if multiplex is None or not multiplex.second_copies:
            return None
        return AdaptiveLimit(initial=min(multiplex.busy_batches + 1, AdaptiveLimit.maximum))

    async def submit(
        self, deployment: str, payload: Any, items: int, priority: Priority, deadline: float | None, timing: RequestTiming | None
    ) -> Any:
        """One request's rows through a deployment's queue; its result, or its error."""
        return await self.get(deployment).submit(payload, items, priority, deadline, timing)

    def existing(self, model: str) -> Dispatcher | None:
        """The model's dispatcher if it has seen a request, without making one."""
        return self.by_model.get(model)

    def busy(self, ignored: Collection[str] = ()) -> bool:
        """Any work queued or in flight for a deployment not in `ignored`: what the full-collection
        schedule avoids, and what shadows wait out."""
        return any((d.queued_items or d.inflight) and name not in ignored for name, d in self.by_model.items())

    def __iter__(self) -> Iterator[Dispatcher]:
        return iter(self.by_model.values())


# Serve's calls between deployments travel over gRPC (RAY_SERVE_THROUGHPUT_OPTIMIZED), whose
# replicas refuse a message over 4 MiB (RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH): a batch of
# encoded images or large tensors past this goes by reference, through Ray's object store.
BY_REFERENCE_BYTES = 3 * 2**20


def payload_bytes(payloads: list[Any]) -> int:
    """About what a batch's payloads weigh on the wire: tensors' bytes, texts' and images' lengths."""
    total = 0
    for p in payloads:
        if hasattr(p, "nbytes"):
            total += int(p.nbytes)
        elif isinstance(p, list):  # texts count at UTF-8's widest, so as not to undercount
            total += sum(len(item) if isinstance(item, bytes) else 4 * len(item) for item in p)
    return total


def handle_sender(handle: Any, router_id: str, node_id: str | None = None) -> SendBatch:
    """A batch as one call to a classifier deployment (`serve_app.models.classifier.Classifier.run`);
    a heavy one by reference (see BY_REFERENCE_BYTES). With `node_id` (this router's Ray node),
    batches go over the link of a replica on that node where one is known (serve_app.link)."""
    # Bound once: each `handle.run` would build a new handle, per batch.
    by_value, by_reference = handle.run, handle.options(_by_reference=True).run

    def heavy(payloads: list[Any]) -> bool:
        return payload_bytes(payloads) > BY_REFERENCE_BYTES

    async def send(payloads: list[Any], queued: int, lane: str, traces: list[str | None] | None) -> BatchReply:
        target = by_reference if heavy(payloads) else by_value
        reply: BatchReply = await target.remote(payloads, router_id, queued, lane, traces)
        return reply

    return MarkedSender(send if node_id is None else LinkedSender(send, router_id, node_id, handle_only=heavy))


def dispatch_settings(args: AppArgs, model: str) -> DispatchSettings:
    """A model's queue settings in the router, from the app's config (also what the scheduling
    simulation runs: benchmarks/simulate.py)."""
    config, sched = args.deployment_config(model), args.scheduling
    return DispatchSettings(
        policy=sched.policy,
        max_queue_items=sched.max_queue_items,
        max_queue_delay_s=sched.max_queue_delay_s,
        max_queued_s=sched.max_queued_s,
        queue_delay_target_s=sched.advanced.queue_delay_target_ms / 1e3,
        max_batch_size=config.batching.max_batch_size,
        batch_wait_timeout_s=config.batching.batch_wait_timeout_s,
        batch_timeout_s=sched.batch_timeout_s,
        breaker_failures=sched.breaker_failures,
        breaker_open_s=sched.breaker_open_s,
        urgent_lane=config.advanced.urgent_lane,
        lane_min_inflight=1 if config.advanced.urgent_session else (config.advanced.bulk_sessions or 1),
        urgent_shares_sessions=not config.advanced.urgent_session,
    )


class MarkedSender:
    """`inner`, counted in MODEL_WORK while its batch is out: the router's image decoders wait
    for it when no core is free (serve_app.protocols.decoders)."""

    def __init__(self, inner: SendBatch) -> None:
        self.inner = inner

    async def __call__(self, payloads: list[Any], queued: int, lane: str, traces: list[str | None] | None) -> BatchReply:
        with MODEL_WORK.held():
            return await self.inner(payloads, queued, lane, traces)
