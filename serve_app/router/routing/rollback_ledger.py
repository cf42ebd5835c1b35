"""Canary rollbacks shared by every router replica of an application.

Each router judges a canary on the calls it routed itself (serve_app.scheduling.traffic). With
several routers, each sees only its share of the canary's calls, and a router that starts later
(autoscaling, or one replacing a dead replica) saw none of the calls that condemned it: on its
own it would send the canary its weight again until it had judged it afresh. So each router sends
the rollbacks standing in it to one small Ray actor per application, every rollback tick and once
before it takes traffic (`Router.reconfigure`), and adopts those the others decided under the
same configured weight.

The actor is detached and placed on the head node where it can be: it outlives the router that
created it, so a lone router that dies and is replaced finds its rollbacks there. As everywhere in
the traffic policy, a rollback stands until the version's weight is changed, across router
restarts and redeploys: a router running another weight for that version removes it from the
ledger, so setting the weight back later has the version judged afresh. To forget every rollback
of an application at once, `ray.kill` the actor (`ledger_name`, namespace `serve_app`). If the
actor is lost, the next exchange creates another, and since every router sends everything that
stands in it each time, the new one holds the live routers' union again within a tick. Whatever
fails here, a router goes on deciding on its own, as it would alone.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from serve_app.scheduling.traffic import Rollback, SharedRollback, TrafficPolicy

logger = logging.getLogger("ray.serve")

NAMESPACE = "serve_app"
SCHEMA = "v1"  # in the actor's name: a detached actor keeps the code it was created with
EXCHANGE_TIMEOUT_S = 5.0
MAX_ENTRIES = 1024  # rollbacks kept per application: far more than configurations change


class RollbackLedger:
    """The rollbacks an application's routers decided: the first reason given for each (model,
    version, weight) is kept; past `max_entries`, the oldest goes."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self.entries: dict[tuple[str, str, float], str] = {}

    def exchange(self, standing: list[SharedRollback], running: list[tuple[str, str, float]]) -> list[SharedRollback]:
        """Take one router's standing rollbacks and the weight it runs each version at (a rollback
        under any other weight is one the operator has since overruled); return all that stand."""
        weights = {(m, v): w for m, v, w in running}
        for key in [k for k in self.entries if weights.get(k[:2], k[2]) != k[2]]:
            del self.entries[key]
        for model, version, weight, reason in standing:
            self.entries.setdefault((model, version, weight), reason)
        while len(self.entries) > self.max_entries:
            del self.entries[next(iter(self.entries))]
        return [(m, v, w, r) for (m, v, w), r in self.entries.items()]


LedgerActor = ray.remote(num_cpus=0, max_restarts=0)(RollbackLedger)


def ledger_name(app_name: str) -> str:
    return f"rollbacks:{SCHEMA}:{app_name}"


def ledger_actor(app_name: str) -> Any:
    """The application's ledger actor (`app_actor`)."""
    return app_actor(LedgerActor, ledger_name(app_name))


def app_actor(actor_class: Any, name: str) -> Any:
    """An application's detached actor of that name: the existing one, or a new one on the head
    node (soft: any node if the head cannot take it). An explicit strategy also keeps it out of
    the creating replica's placement group, which goes when the replica goes."""
    head = next((n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]), None)
    strategy = NodeAffinitySchedulingStrategy(head, soft=True) if head else "DEFAULT"
    return actor_class.options(
        name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, scheduling_strategy=strategy,
    ).remote()  # fmt: skip


class SharedRollbacks:
    """One router's link to its application's ledger."""

    def __init__(self, app_name: str, timeout_s: float = EXCHANGE_TIMEOUT_S) -> None:
        self.app_name = app_name
        self.timeout_s = timeout_s
        self.actor: Any = None
        # The lookup in flight: one at a time, however long Ray takes (a thread cannot be cancelled).
        self.lookup: asyncio.Future[Any] | None = None
        self.failing = False  # logged once per run of failures

    async def exchange(self, policy: TrafficPolicy) -> list[Rollback]:
        """Send this router's standing rollbacks, adopt the others'; the newly adopted ones."""
        try:
            if self.actor is None:
                if self.lookup is None or (self.lookup.done() and self.lookup.exception() is not None):
                    self.lookup = asyncio.ensure_future(asyncio.to_thread(ledger_actor, self.app_name))
                self.actor = await asyncio.wait_for(asyncio.shield(self.lookup), self.timeout_s)
                self.lookup = None
            call = self.actor.exchange.remote(policy.standing(), policy.running())
            shared = await asyncio.wait_for(call, self.timeout_s)
        except Exception as e:  # Ray busy or the actor gone: deciding alone meanwhile
            if isinstance(e, RayActorError):
                self.actor = None  # gone: look it up (or create it) again next time
            if not self.failing:
                logger.warning("traffic: sharing rollbacks with the other routers failed (%r); deciding alone", e)
            self.failing = True
            return []
        self.failing = False
        return policy.adopt(shared)
