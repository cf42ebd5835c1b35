"""Where a multiplexed model's next batch goes, among the replicas of the pool that serves it.

Many models share a pool of replicas, each replica holding at most `max_models` of them and
loading one on its first batch there (evicting its least recently used model when full). A
router sends each batch of one model to one replica, and a load costs seconds, so the choice
weighs three things:

1. a replica that holds the model answers at once: send there while a holder has room
   (fewer than `busy_batches` of this router's batches in flight);
2. when every holder is busy, a hot model is worth a second copy (the case Ray Serve's own
   multiplexing leaves open, ray-project/ray#48741): send to a replica with room that can load it
   without evicting a model in use (a free slot, or a least recently used model that has had no
   batch for `copy_evicts_idle_s`), so that its throughput grows with the replicas. A model
   between two batches is not idle in that sense: when more models are asked for than the pool
   holds, a second copy would push out one that is asked for again a moment later, and the pool
   would load more and answer less (the multiplex scenario's Zipf phases);
3. failing both, wait at a holder rather than load where a model in use would be evicted.

A model no replica holds goes where it costs least: a free slot first, then the replica whose
least recently used model is idle and oldest.

The router's own view, not the replicas' reports alone: a replica reports what it holds a
moment late, so a model routed to a replica counts as held there from that moment, until the
replica's report drops it or it is evicted in this view. No Ray here: `PoolView` is fed what
the router routes, what completes and what the replicas report, with an injected clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class ReplicaState:
    """One replica of the pool, as this router sees it."""

    # model -> when this router last routed a batch of it there (or first saw it reported):
    # the replica's models in least-recently-used order.
    models: dict[str, float] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)  # model -> this router's batches in flight

    def busy(self) -> int:
        return sum(self.inflight.values())

    def idle_lru(self) -> str | None:
        """The least recently used model with no batch in flight: what a load would evict."""
        idle = [(used, m) for m, used in self.models.items() if not self.inflight.get(m)]
        return min(idle)[1] if idle else None


@dataclass(frozen=True)
class Choice:
    """Replica ids ranked, best first (each rank a list the caller picks from by load), and why."""

    ranks: list[list[str]]
    reason: str  # "holder", "second copy", "wait for a holder", "load", "no replica"


class PoolView:
    """What one router knows of a pool's replicas, and the placement rule on top of it."""

    def __init__(
        self,
        max_models: int,
        busy_batches: int = 2,
        clock: Callable[[], float] = time.monotonic,
        report_lag_s: float = 10.0,
        second_copies: bool = True,
        copy_evicts_idle_s: float = 10.0,
    ) -> None:
        if max_models < 1 or busy_batches < 1:
            raise ValueError("max_models and busy_batches must be at least 1")
        self.max_models = max_models
        self.busy_batches = busy_batches
        self.clock = clock
        # How long a model routed to a replica stays held in this view though the replica's report
        # does not list it: a report says what a replica held a moment ago, before that load.
        self.report_lag_s = report_lag_s
        self.second_copies = second_copies  # rule 2 above; off, a busy model waits at its holder
        self.copy_evicts_idle_s = copy_evicts_idle_s
        self.replicas: dict[str, ReplicaState] = {}

    # -- what the router learns -------------------------------------------------------------

    def set_replicas(self, reported: Mapping[str, Iterable[str]]) -> None:
        """The running replicas and the models each reports holding. A replica gone is dropped with
        its batches; a model a replica does not report is dropped unless a batch of it is in
        flight there or one was routed there within `report_lag_s` (the report may predate its
        load); a newly reported one is added as just used."""
        now = self.clock()
        for gone in set(self.replicas) - set(reported):
            del self.replicas[gone]
        for replica, models in reported.items():
            state = self.replicas.setdefault(replica, ReplicaState())
            held = set(models)
            stale = [
                m for m, used in state.models.items()
                if m not in held and not state.inflight.get(m) and now - used > self.report_lag_s
            ]  # fmt: skip
            for m in stale:
                del state.models[m]
            for m in held - set(state.models):
                state.models[m] = now
            self._evict_past_room(state)

    def routed(self, replica: str, model: str) -> None:
        """A batch of `model` went to `replica`: the replica holds it now (or is loading it), used last."""
        state = self.replicas.setdefault(replica, ReplicaState())
        state.models.pop(model, None)
        state.models[model] = self.clock()
        state.inflight[model] = state.inflight.get(model, 0) + 1
        self._evict_past_room(state)

    def completed(self, replica: str, model: str) -> None:
        state = self.replicas.get(replica)
        if state is None or not state.inflight.get(model):
            return
        state.inflight[model] -= 1
        if not state.inflight[model]:
            del state.inflight[model]

    def _evict_past_room(self, state: ReplicaState) -> None:
        """Past `max_models`, the replica evicts its least recently used idle models, as it will."""
        while len(state.models) > self.max_models and (victim := state.idle_lru()) is not None:
            del state.models[victim]

    # -- the rule ------------------------------------------------------------------------------

    def holders(self, model: str) -> list[str]:
        return [r for r, s in self.replicas.items() if model in s.models]

    def choose(self, model: str, candidates: Iterable[str] | None = None) -> Choice:
        """Where the next batch of `model` goes, among `candidates` (default: every replica known)."""
        names = [r for r in (self.replicas if candidates is None else candidates) if r in self.replicas]
        if not names:
            return Choice([], "no replica")
        holders = [r for r in names if model in self.replicas[r].models]
        others = [r for r in names if r not in holders]
        free = [r for r in holders if self.replicas[r].busy() < self.busy_batches]
        if free:
            return Choice([self._by_load(free), self._by_load([r for r in holders if r not in free])], "holder")
        if holders:
            copies = self._loadable(others, self.copy_evicts_idle_s) if self.second_copies else []
            if copies:
                return Choice([*copies, self._by_load(holders)], "second copy")
            return Choice([self._by_load(holders)], "wait for a holder")
        loadable = self._loadable(others)
        if loadable:
            return Choice(loadable, "load")
        return Choice([self._by_load(others)], "load")  # every slot holds a model in use: the least busy

    def _loadable(self, replicas: list[str], idle_s: float = 0.0) -> list[list[str]]:
        """Replicas with room that can load a model without evicting one in use (nor one used
        within `idle_s`), one a rank: a free slot first (the least busy), then the one whose idle
        least recently used model is oldest. One a rank, so that batches chosen together (before
        any of them is seen routed) all load the model on the same replica, not one copy each."""
        room = [r for r in replicas if self.replicas[r].busy() < self.busy_batches]
        slots = [r for r in room if len(self.replicas[r].models) < self.max_models]
        cutoff = self.clock() - idle_s
        evictable = [(self._lru_age(r), r) for r in room if r not in slots and self._lru_age(r) <= cutoff]
        return [[r] for r in [*self._by_load(slots), *(r for _, r in sorted(evictable))]]

    def _lru_age(self, replica: str) -> float:
        state = self.replicas[replica]
        victim = state.idle_lru()
        return state.models[victim] if victim is not None else float("inf")

    def _by_load(self, replicas: list[str]) -> list[str]:
        return sorted(replicas, key=lambda r: self.replicas[r].busy())
