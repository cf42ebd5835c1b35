"""What routers and model replicas exchange: the one module both sides import.

A router sends a classifier replica batches (`run(payloads, router, router_queued, lane)`)
and gets a `BatchReply` (through Serve's handle, or over the replica's `LinkAddress` from a
router on its node); each batch says how much work the router still holds for the
model, which the replica keeps per router (`RouterLoad`) for Serve's autoscaler. Requests
carry a `Priority`; high-priority batches may travel on a lane of their own (`URGENT`).
Nothing here imports Ray, the router or the models.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

# The lanes a classifier replica runs batches on: high-priority work on its own session
# beside the bulk one (serve_app.models.classifier), so it never waits for a running bulk batch.
BULK, URGENT = "bulk", "urgent"

# What each classifier replica reports to Serve's autoscaler: batches running that came over the
# link (serve_app.link), which Serve's count of ongoing requests does not see.
LINK_ONGOING = "link_ongoing_batches"


class Priority(IntEnum):
    """Lower value is served first."""

    HIGH = 0
    NORMAL = 1
    LOW = 2

    @classmethod
    def parse(cls, value: str | int | None, default: Priority | None = None) -> Priority:
        """From a header (`high|normal|low`) or Triton's integer `parameters.priority`.

        Triton counts levels from 1 (highest); 0 means "the model's default".
        """
        if value is None or value == "" or value == 0:
            return default if default is not None else cls.NORMAL
        if isinstance(value, bool):
            raise ValueError(f"priority must be high, normal or low, got {value!r}")
        if isinstance(value, int):
            if value < 0:
                raise ValueError(f"priority must be >= 0, got {value}")
            return cls(min(value - 1, cls.LOW))
        if not isinstance(value, str):  # a float, list or object from a JSON body
            raise ValueError(f"priority must be high, normal, low or an integer level, got {value!r}")
        try:
            return cls[value.strip().upper()]
        except KeyError:
            raise ValueError(f"priority must be high, normal or low, got {value!r}") from None


@dataclass
class BatchReply:
    """What a replica returns for one batch: a result or an exception per payload, and timings."""

    results: list[Any]
    wait_s: float  # queued at the replica before the batch started
    exec_s: float  # running the batch
    max_batch_size: int | None = None  # the replica's live batching config, so user_config reaches the router
    batch_wait_timeout_s: float | None = None
    link: LinkAddress | None = None  # where a router on the replica's node may send its next batches
    # Seconds the batch waited for its model to load on the replica (a multiplexed pool's cold
    # batch): not the model's cost, so the router's estimate of a batch leaves it out.
    load_s: float = 0.0
    # A pool replica's id and the models it holds as it answers (serve_app.scheduling.coldstart).
    replica: str | None = None
    held: tuple[str, ...] | None = None


@dataclass(frozen=True)
class LinkAddress:
    """A replica's same-node channel for batches (serve_app.link): its unix socket, the token a
    connection must open with, and the Ray node it is on (only routers there can reach it)."""

    path: str
    token: bytes
    node_id: str


class RouterLoad:
    """Work that routers hold for a model, as the model's replicas last heard it.

    Each batch a router sends carries how much more it still holds for that model; the
    replica keeps the latest figure per router and reports the sum to Serve's autoscaler
    (`record_autoscaling_stats`). A router that stops sending stops counting after `ttl_s`,
    so the demand fades when load ends.
    """

    METRIC = "router_queued_batches"

    def __init__(self, ttl_s: float = 5.0) -> None:
        self.ttl_s = ttl_s
        self._latest: dict[str, tuple[float, float]] = {}  # router -> (batches, when)

    def report(self, router: str, batches: float, now: float) -> None:
        self._latest[router] = (batches, now)

    def total(self, now: float) -> float:
        self._latest = {r: v for r, v in self._latest.items() if now - v[1] <= self.ttl_s}
        return sum(b for b, _ in self._latest.values())


# (payloads, rows still queued in this router for the model, lane name, each payload's
# `traceparent` for the replica or None when no request in the batch is traced) -> reply
SendBatch = Callable[[list[Any], int, str, list[str | None] | None], Awaitable[BatchReply]]
