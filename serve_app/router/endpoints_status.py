"""`/router/status`: what one router replica holds and has learned, for operators."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Header

from serve_app.router.catalog import READY_TIMEOUT_S
from serve_app.router.parts import RouterParts, router_parts

api = APIRouter()
PARTS = Depends(router_parts)


@api.get("/router/status")
async def router_status(authorization: str | None = Header(None), parts: RouterParts = PARTS) -> dict[str, Any]:
    """This router replica's queues, learned limits, shedding and cascade counts."""
    parts.callers.authenticate(authorization)
    cascade = {route: dict(c.counts) for route, c in parts.cascades.items() if c.counts}
    generators = parts.catalog.generators()
    # One replica of each generator: its decode loop's running and waiting sequences, KV occupancy, TTFT, ITL.
    stats = await asyncio.gather(*(_generator_stats(parts, g) for g in generators))
    return {
        "router": parts.router_id,
        "models": {d.model: d.snapshot() for d in parts.dispatchers},
        "routes": cascade,
        "generators": dict(zip(generators, stats, strict=True)),
        "gc": parts.gc_pauses.snapshot(),
    }


async def _generator_stats(parts: RouterParts, name: str) -> dict[str, Any] | None:
    try:
        stats: dict[str, Any] = await asyncio.wait_for(parts.handles[name].stats.remote(), READY_TIMEOUT_S)
        return stats
    except Exception:  # status must answer even when a generator does not
        return None
