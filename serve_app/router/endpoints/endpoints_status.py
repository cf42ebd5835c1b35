"""`/router/status`: what one router replica holds and has learned, for operators."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Header

from serve_app.link.client import LinkedSender
from serve_app.router.edge import direct
from serve_app.router.parts import RouterParts, router_parts

api = APIRouter()
PARTS = Depends(router_parts)


@api.get("/router/status")
async def router_status(authorization: str | None = Header(None), parts: RouterParts = PARTS) -> dict[str, Any]:
    """This router replica's queues, learned limits, shedding and cascade counts (operators only)."""
    parts.callers.operator(authorization)
    cascade = {route: dict(c.counts) for route, c in parts.cascades.items() if c.counts}
    generators = parts.catalog.generators()
    # One replica of each generator: its decode loop's running and waiting sequences, KV occupancy, TTFT, ITL.
    stats = await asyncio.gather(*(parts.generator_stats.get(g, parts.handles[g].stats.remote) for g in generators))
    return {
        "router": parts.router_id,
        "models": {d.model: {**d.snapshot(), "transport": _transport(d.send)} for d in parts.dispatchers},
        "routes": cascade,
        # Per multiplexed pool: how long a load takes, what each replica held when it last answered.
        "pools": {pool: c.snapshot() for pool, c in parts.dispatchers.cold_starts.items()},
        # Per route: which classes may be answered by the light tier alone, the level, how many were.
        "degrade": {route: c.degrading.status() for route, c in parts.cascades.items() if c.degrading is not None},
        "generators": dict(zip(generators, stats, strict=True)),
        "generator_breakers": {g: b.state.name.lower() for g, b in parts.breakers.items()},
        "gc": parts.gc_pauses.snapshot(),
        "tasks": len(asyncio.all_tasks()),
        # v2 infer ahead of Serve's per-request wrapper (serve_app/router/edge/direct.py)
        "direct_infer": direct.active(),
        "router_delay": _router_delay(parts),
        "versions": parts.versions.snapshot(),
        "cache": parts.cache.snapshot(),
    }


def _transport(send: Any) -> dict[str, Any] | None:
    """How the router's batches for a model travelled: over same-node links or through Serve."""
    send = getattr(send, "inner", send)  # under the MarkedSender that counts them
    return send.snapshot() if isinstance(send, LinkedSender) else None


def _router_delay(parts: RouterParts) -> dict[str, Any] | None:
    """The router's own overload control: how late its loop runs, and whom it refuses for it."""
    if parts.gate is None:
        return None
    lag_ms = round(parts.loop_lag.lag_s * 1e3, 1) if parts.loop_lag is not None else None
    return {"lag_ms": lag_ms, **parts.gate.status()}
