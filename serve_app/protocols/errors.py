"""The one place where errors become HTTP responses, in each protocol's own shape."""

from __future__ import annotations

import math

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from serve_app.errors import ServeAppError


def _headers(exc: ServeAppError) -> dict[str, str]:
    if exc.retry_after_s is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}


def v2_error(exc: ServeAppError) -> JSONResponse:
    """Open Inference Protocol: `{"error": "<message>"}`."""
    return JSONResponse({"error": exc.message}, status_code=exc.status_code, headers=_headers(exc))


def openai_error(exc: ServeAppError) -> JSONResponse:
    """OpenAI: `{"error": {"message", "type", "param", "code"}}`."""
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    body = {"error": {"message": exc.message, "type": kind, "param": None, "code": exc.code}}
    return JSONResponse(body, status_code=exc.status_code, headers=_headers(exc))


def from_http_exception(exc: HTTPException) -> ServeAppError:
    """Starlette's and FastAPI's own errors (an unparseable body, an unknown path, the edge's body
    limit raised into a body read) as the app's, so that they leave in the protocol's shape too."""
    message = f"malformed request body: {exc.detail}" if exc.status_code == 400 else str(exc.detail)
    retry_after = (exc.headers or {}).get("Retry-After")
    error = ServeAppError(message, float(retry_after) if retry_after else None)
    error.status_code = exc.status_code
    error.code = {400: "invalid_input", 413: "payload_too_large", 503: "overloaded"}.get(exc.status_code, "http_error")
    return error


def error_response(path: str, exc: ServeAppError) -> JSONResponse:
    return openai_error(exc) if path.startswith("/v1/") else v2_error(exc)
