"""Canary rollbacks shared by every router replica of an application.

Each router judges a canary on the calls it routed itself (serve_app.scheduling.traffic). With
several routers, each sees only its share of the canary's calls, and a router that starts later
(autoscaling, or one replacing a dead replica) saw none of the calls that condemned it: on its
own it would send the canary its weight again until it had judged it afresh. So every rollback
tick, each router sends the rollbacks standing in it to one small Ray actor per application and
adopts those the others decided, under the same configured weight.

The actor is detached: it outlives the router that created it, so a lone router that dies and is
replaced finds its rollbacks there. As everywhere in the traffic policy, a rollback stands until
the version's weight is changed, across router restarts and redeploys; give the version a new
weight to have it judged afresh. If the actor is lost (its node died), the next exchange creates
another, and since every router sends everything that stands in it each time, the new one holds
the routers' union again within a tick. Whatever fails here, a router goes on deciding on its
own, as it would alone.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from serve_app.scheduling.traffic import Rollback, SharedRollback, TrafficPolicy

logger = logging.getLogger("ray.serve")

NAMESPACE = "serve_app"
EXCHANGE_TIMEOUT_S = 5.0
MAX_ENTRIES = 1024  # rollbacks kept per application: far more than configurations change


class RollbackLedger:
    """The union of the rollbacks an application's routers decided: the first reason given for each
    (model, version, weight) is kept; past `max_entries`, the oldest goes."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self.entries: dict[tuple[str, str, float], str] = {}

    def exchange(self, standing: list[SharedRollback]) -> list[SharedRollback]:
        """Add what one router has standing; return every rollback known."""
        for model, version, weight, reason in standing:
            self.entries.setdefault((model, version, weight), reason)
        while len(self.entries) > self.max_entries:
            del self.entries[next(iter(self.entries))]
        return [(m, v, w, r) for (m, v, w), r in self.entries.items()]


def ledger_name(app_name: str) -> str:
    return f"rollbacks:{app_name}"


def ledger_actor(app_name: str) -> Any:
    """The application's ledger actor: the existing one, or a new one."""
    actor = ray.remote(num_cpus=0, max_restarts=0)(RollbackLedger)
    options = {"name": ledger_name(app_name), "namespace": NAMESPACE, "lifetime": "detached", "get_if_exists": True}
    return actor.options(**options).remote()


class SharedRollbacks:
    """One router's link to its application's ledger."""

    def __init__(self, app_name: str, timeout_s: float = EXCHANGE_TIMEOUT_S) -> None:
        self.app_name = app_name
        self.timeout_s = timeout_s
        self.actor: Any = None
        self.failing = False  # logged once per run of failures

    async def exchange(self, policy: TrafficPolicy) -> list[Rollback]:
        """Send this router's standing rollbacks, adopt the others'; the newly adopted ones."""
        try:
            if self.actor is None:
                self.actor = await asyncio.to_thread(ledger_actor, self.app_name)
            shared = await asyncio.wait_for(self.actor.exchange.remote(policy.standing()), self.timeout_s)
        except Exception as e:  # its owner gone, or Ray busy: look it up again next tick
            self.actor = None
            if not self.failing:
                logger.warning("traffic: sharing rollbacks with the other routers failed (%r); deciding alone", e)
            self.failing = True
            return []
        self.failing = False
        return policy.adopt(shared)
