"""Open Inference Protocol v2 (KServe v2 / Triton HTTP): health, metadata and inference."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response

from serve_app import __version__
from serve_app.manifest import Manifest
from serve_app.protocols import v2, v2_schema
from serve_app.router.endpoints.docs import INFER_BODY, PRIORITY_DOC, SESSION_DOC, TIMEOUT_DOC, V2_ERRORS
from serve_app.router.parts import RouterParts, router_parts
from serve_app.router.routing import catalog

api = APIRouter()
PARTS = Depends(router_parts)


# First: Serve names each request's route by trying the routes in order (serve_app.router.http).
@api.post("/v2/models/{name}/infer", openapi_extra=INFER_BODY, responses={200: {"model": v2_schema.InferResponse}, **V2_ERRORS})
@api.post(
    "/v2/models/{name}/versions/{version}/infer",
    openapi_extra=INFER_BODY,
    responses={200: {"model": v2_schema.InferResponse}, **V2_ERRORS},
)
async def infer(
    request: Request,
    name: str,
    version: str | None = None,
    x_priority: str | None = Header(None, description=PRIORITY_DOC),
    x_request_timeout_ms: str | None = Header(None, description=TIMEOUT_DOC),
    authorization: str | None = Header(None, description="Bearer <API key>, when keys are configured"),
    inference_header_content_length: str | None = Header(
        None, description="binary tensor data extension: length of the JSON part of the body"
    ),
    x_session_key: str | None = Header(None, description=SESSION_DOC),
    cache_control: str | None = Header(None, description="no-cache or no-store: answer without the response cache"),
    parts: RouterParts = PARTS,
) -> Response:
    """Declared for the OpenAPI document and for Serve's route names only: every v2 infer call is
    answered by the router's edge before FastAPI routes it (serve_app.router.edge.infer_edge)."""
    raise RuntimeError(f"v2 infer for {name!r} reached FastAPI's route; the router's edge answers every such call")


@api.get("/v2/health/live")
async def live() -> dict[str, bool]:
    return {"live": True}


@api.get("/v2/health/ready")
async def ready(parts: RouterParts = PARTS) -> JSONResponse:
    ok = await parts.catalog.all_ready(parts.catalog.serving())
    return JSONResponse({"ready": ok}, status_code=200 if ok else 503)


@api.get("/v2")
async def server_metadata() -> v2.ServerMetadata:
    return v2.ServerMetadata(name="serve-app", version=__version__, extensions=v2.EXTENSIONS)


async def metadata(parts: RouterParts, name: str, version: str | None) -> v2.ModelMetadata:
    manifest = await _manifest(parts, name, version)
    versions = [version] if version is not None else parts.catalog.versions(name)
    return catalog.model_metadata(name, manifest, parts.catalog.platform(name), versions)


async def _manifest(parts: RouterParts, name: str, version: str | None) -> Manifest:
    """The metadata a name (and version) shows (a route shows its light tier's), after 404 checks."""
    parts.catalog.known(name)
    return await parts.catalog.manifest(parts.catalog.deployment(name, version))


@api.get("/v2/models/{name}", responses=V2_ERRORS)
@api.get("/v2/models/{name}/versions/{version}", responses=V2_ERRORS)
async def model_metadata(
    name: str, version: str | None = None, authorization: str | None = Header(None), parts: RouterParts = PARTS
) -> v2.ModelMetadata:
    parts.callers.authenticate(authorization)
    return await metadata(parts, name, version)


@api.get("/v2/models/{name}/ready", responses=V2_ERRORS)
@api.get("/v2/models/{name}/versions/{version}/ready", responses=V2_ERRORS)
async def model_ready(name: str, version: str | None = None, parts: RouterParts = PARTS) -> JSONResponse:
    """A version is ready when its deployment answers; a model, when every version that takes its
    traffic does; a route, when both tiers are."""
    ok = await parts.catalog.all_ready(ready_members(parts, name, version))
    return JSONResponse({"name": name, "ready": ok}, status_code=200 if ok else 503)


def ready_members(parts: RouterParts, name: str, version: str | None) -> list[str]:
    """The deployments that must answer for a name (and version) to be ready; 404 for an unknown name."""
    parts.catalog.known(name)
    if version is not None:
        return [parts.catalog.deployment(name, version)] if name in parts.args.models else parts.catalog.members(name)
    return [d for m in parts.catalog.members(name) for d in parts.versions.serving(m)]


@api.get("/v2/models/{name}/config", responses=V2_ERRORS)
@api.get("/v2/models/{name}/versions/{version}/config", responses=V2_ERRORS)
async def model_config(
    name: str, version: str | None = None, authorization: str | None = Header(None), parts: RouterParts = PARTS
) -> dict[str, Any]:
    parts.callers.authenticate(authorization)
    return await config(parts, name, version)


async def config(parts: RouterParts, name: str, version: str | None) -> dict[str, Any]:
    """Triton's model config of a name (and version), as HTTP and gRPC both show it."""
    manifest = await _manifest(parts, name, version)
    max_batch_size = int(parts.catalog.batching[parts.catalog.deployment(name, version)]["max_batch_size"])
    return catalog.triton_config(name, manifest, max_batch_size, parts.catalog.platform(name))
