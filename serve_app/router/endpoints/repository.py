"""Triton's model repository extension over HTTP: index, load, unload. gRPC's RepositoryIndex,
RepositoryModelLoad and RepositoryModelUnload (grpc_service.py) call the same functions.

Which models stand unloaded is shared by the application's routers through a ledger
(serve_app.router.routing.repository); only operators may load and unload.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Depends, Header
from pydantic import BaseModel

from serve_app.errors import Forbidden, NotFound, Unavailable
from serve_app.router.endpoints.docs import REPOSITORY_ERRORS, V2_ERRORS
from serve_app.router.parts import RouterParts, router_parts
from serve_app.router.routing import catalog

api = APIRouter()
PARTS = Depends(router_parts)
DRAIN_POLL_S = 0.05


class IndexRequest(BaseModel):
    """Triton's index request body: with `ready`, only the models that can take requests now."""

    ready: bool = False


@api.post("/v2/repository/index", responses=V2_ERRORS)
async def repository_index(
    body: IndexRequest | None = None, authorization: str | None = Header(None), parts: RouterParts = PARTS
) -> list[dict[str, str]]:
    """Every model's versions with their state (and why one is unavailable), and the routes."""
    parts.callers.authenticate(authorization)
    return await index(parts, ready_only=body is not None and body.ready)


@api.post("/v2/repository/models/{name}/load", responses=REPOSITORY_ERRORS)
async def repository_load(name: str, authorization: str | None = Header(None), parts: RouterParts = PARTS) -> dict[str, Any]:
    """Serve a model an operator unloaded, or one put under a multiplexed pool's path since the
    build, on every router (operators only)."""
    await load(parts, authorization, name)
    return {}


@api.post("/v2/repository/models/{name}/unload", responses=REPOSITORY_ERRORS)
async def repository_unload(name: str, authorization: str | None = Header(None), parts: RouterParts = PARTS) -> dict[str, Any]:
    """Refuse a model's new requests on every router, then answer once this router has no work of
    it left, queued or running (operators only). A multiplexed pool's replicas let go of it as
    they load others."""
    await unload(parts, authorization, name)
    return {}


async def index(parts: RouterParts, ready_only: bool = False) -> list[dict[str, str]]:
    """The index as Triton gives it: name, version, state (READY or UNAVAILABLE), and a reason."""
    deployments = parts.catalog.models
    ready = dict(zip(deployments, await asyncio.gather(*(parts.catalog.is_ready(d) for d in deployments)), strict=True))
    out = [_indexed(parts, d, ok) for d, ok in ready.items()]
    for route, spec in parts.args.routes.items():
        ok = ready[spec.light] and ready[spec.heavy]
        out.append({"name": route, "version": catalog.ROUTE_VERSION, "state": "READY" if ok else "UNAVAILABLE"})
    if ready_only:
        return [entry for entry in out if entry["state"] == "READY"]
    if parts.members is not None and parts.args.pools:
        # What a pool's path holds now and no router serves yet: `load` serves it (members.py).
        for name in parts.members.candidates(await asyncio.to_thread(parts.members.listed)):
            out.append({"name": name, "version": "", "state": "UNAVAILABLE", "reason": "not loaded"})
    return out


async def load(parts: RouterParts, authorization: str | None, name: str) -> None:
    _operator(parts, authorization)
    await _set_loaded(parts, name, True)


async def unload(parts: RouterParts, authorization: str | None, name: str) -> None:
    _operator(parts, authorization)
    await _set_loaded(parts, name, False)
    deployments = list(parts.args.versions(name).values())
    deadline = time.monotonic() + parts.args.limits.infer_timeout_s
    while any(_busy(parts, d) for d in deployments) and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)


def _indexed(parts: RouterParts, deployment: str, ready: bool) -> dict[str, str]:
    served = parts.args.served[deployment]
    entry = {"name": served.model, "version": served.version, "state": "READY" if ready else "UNAVAILABLE"}
    if deployment in parts.catalog.unloaded:
        entry["reason"] = "unloaded"
    elif (reason := parts.args.unavailable.get(deployment)) is not None:
        entry["reason"] = reason
    return entry


def _operator(parts: RouterParts, authorization: str | None) -> None:
    """An operator's key. An open server (no keys configured) has none, and refuses: as Triton
    refuses load and unload unless started with explicit model control, taking a model out of
    service is not something any caller of an open server may do."""
    if parts.callers.tenants.open:
        raise Forbidden("load and unload need an operator's key: configure tenants, one with `operator: true`")
    parts.callers.operator(authorization)


def _busy(parts: RouterParts, deployment: str) -> bool:
    d = parts.dispatchers.existing(deployment)
    return d is not None and bool(d.queued_items or d.inflight)


async def _set_loaded(parts: RouterParts, name: str, loaded: bool) -> None:
    # A name the router does not serve may be a model directory put under a pool's path since the
    # build: checked here, then served by every router (members.py).
    members = parts.members if loaded and name not in parts.args.models and name not in parts.args.routes else None
    pool = None  # the pool a model new since the build joins
    if members is not None:
        pool, _ = await asyncio.to_thread(members.find, name)
    elif name not in parts.args.models:
        raise NotFound(f"unknown model {name!r}; the repository holds {sorted(parts.args.models)}")
    if parts.repository is None:  # no application ledger (a router on its own): this router alone
        if members is not None and pool is not None:  # (both or neither: the checker sees them apart)
            members.adopt({name: pool})
        models = set(parts.catalog.unloaded_models())
        parts.catalog.set_unloaded(frozenset(models - {name} if loaded else models | {name}))
        return
    try:
        await parts.repository.set(name, loaded, time.time(), pool)
    except Exception as e:
        raise Unavailable(f"the model repository could not be changed ({type(e).__name__}); try again", 1.0) from e
