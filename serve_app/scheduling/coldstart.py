"""Whether a multiplexed pool's model must load before it can answer, and for how long.

A pool's replica loads a model on its first batch there (serve_app.models.pool), which takes
seconds. The router learns what its pools hold from their own answers: every batch reply of a
pool replica names the replica and the models it holds as it answers, and a batch that waited
for a load says how long (`BatchReply.held`, `replica`, `load_s`). A model that no replica was
last seen holding must load first. Admission adds that load to the request's predicted time
(`Dispatcher`): a request whose deadline the load would miss is refused at once, with the load's
time as Retry-After, rather than queued to wait for it, and the load starts anyway, so that the
retry finds the model loaded.

A replica loads one model at a time, so loads queue there, and every batch behind a load waits
for it. When more models are asked for than the pool's replicas can load (a long tail of rarely
asked models), the loads' queue would grow without bound and the requests in it time out. So
each router keeps at most `loads_per_replica` loads per replica in flight (models with a batch
out that no replica held when it was sent): past that, a request for another model that is not
held is refused at once (503, Retry-After the loads ahead), unless it is of the highest class.
The bound is each router's own, and a load counts from its first batch's sending, not from the
request's admission: a burst of requests for different cold models within one batch wait may
all go out, and N routers may send N times the bound.

What one router sees is what its own batches were answered with: a load that another router's
batch caused, or a replica that stopped answering, is unknown to it. So a replica not heard from
for `stale_s` no longer counts, and with nothing known (no replica heard from lately, no load
seen yet) nothing is added: admit, and learn.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from serve_app.contract import BatchReply, SendBatch


@dataclass
class ColdStart:
    """One pool, as one router knows it: what each replica held when it last answered, and how
    long a load takes (an EWMA of the loads its batches waited for)."""

    stale_s: float = 30.0
    smoothing: float = 0.3
    clock: Callable[[], float] = time.monotonic
    loads_per_replica: int = 2  # the one loading and one waiting: a replica never idles between loads
    load_s: float = 0.0  # 0 until a load has been seen
    _held: dict[str, tuple[float, frozenset[str]]] = field(default_factory=dict)  # replica -> (when, models)
    _warming: dict[str, float] = field(default_factory=dict)  # model -> when its load was started
    _loading: Counter[str] = field(default_factory=Counter)  # model -> its batches in flight sent cold

    def observe(self, replica: str, held: Iterable[str], load_s: float = 0.0) -> None:
        """A replica answered a batch, holding `held`; the batch waited `load_s` for its model."""
        self._held[replica] = (self.clock(), frozenset(held))
        if load_s > 0:
            self.load_s = load_s if self.load_s == 0 else self.load_s + self.smoothing * (load_s - self.load_s)

    def _fresh(self) -> list[frozenset[str]]:
        now = self.clock()
        return [held for seen, held in self._held.values() if now - seen <= self.stale_s]

    def cold_s(self, model: str) -> float:
        """Seconds a batch of `model` would wait for its load: 0 when a replica holds it (or is
        loading it for a request refused just now), or when nothing is known."""
        now = self.clock()
        fresh = self._fresh()
        if not fresh or any(model in held for held in fresh) or self.load_s == 0:
            return 0.0
        started = self._warming.get(model)
        if started is not None and now - started < 2 * self.load_s:
            return max(self.load_s - (now - started), 0.0)  # what is left of the load under way
        return self.load_s

    def holders(self, model: str) -> int:
        """The replicas that held `model` when they last answered (lately)."""
        return sum(model in held for held in self._fresh())

    def sent(self, model: str, cold: bool) -> None:
        """A batch of `model` went out; `cold`: no replica held the model (it will load)."""
        if cold:
            self._loading[model] += 1

    def answered(self, model: str, cold: bool) -> None:
        """That batch came back (or failed)."""
        if cold:
            self._loading[model] -= 1
            if self._loading[model] <= 0:
                del self._loading[model]

    def loads_ahead_s(self, model: str) -> float | None:
        """None while a load of `model` may go out now; else the seconds of loads ahead of it
        (the loads in flight over the replicas), as a Retry-After: every replica already has
        `loads_per_replica` loads from this router, and `model` is neither held nor among them."""
        if model in self._loading or self.cold_s(model) == 0:
            return None
        replicas = max(1, len(self._fresh()))
        if len(self._loading) < self.loads_per_replica * replicas:
            return None
        return self.load_s * len(self._loading) / replicas

    def snapshot(self) -> dict[str, object]:
        """For /router/status: the learned load time, and what each replica held when it last answered."""
        now = self.clock()
        return {
            "load_s": round(self.load_s, 3),
            "loading": sorted(self._loading),
            "held": {r: {"models": sorted(held), "age_s": round(now - seen, 1)} for r, (seen, held) in self._held.items()},
        }

    def should_warm(self, model: str) -> bool:
        """Whether to start `model`'s load now (a request was refused for it): once per load time."""
        now = self.clock()
        started = self._warming.get(model)
        if started is not None and now - started < 2 * self.load_s:
            return False
        self._warming[model] = now
        return True


class ModelColdStart:
    """One model's side of its pool's `ColdStart`, as that model's dispatcher uses it.
    `warm_up()` sends the model an empty batch, which loads it on the replica chosen for it."""

    def __init__(self, model: str, pool: ColdStart, warm_up: Callable[[], object]) -> None:
        self.model = model
        self.pool = pool
        self.warm_up = warm_up

    def cold_s(self) -> float:
        return self.pool.cold_s(self.model)

    def loads_ahead_s(self) -> float | None:
        return self.pool.loads_ahead_s(self.model)

    async def send(
        self, send: SendBatch, payloads: list[Any], queued: int, lane: str, traces: list[str | None] | None
    ) -> BatchReply:
        """One batch through `send`, counted as a load while no replica was seen holding the
        model, and what its answer says the pool holds."""
        cold = self.cold_s() > 0
        self.pool.sent(self.model, cold)
        try:
            reply = await send(payloads, queued, lane, traces)
        finally:
            self.pool.answered(self.model, cold)
        self.observe(reply)
        return reply

    def observe(self, reply: BatchReply) -> None:
        if reply.replica is not None and reply.held is not None:
            self.pool.observe(reply.replica, reply.held, reply.load_s)

    def refused(self) -> None:
        """A request was refused because the load would miss its deadline: start the load."""
        if self.pool.should_warm(self.model):
            self.warm_up()
