"""The one place where errors become HTTP responses, in each protocol's own shape."""

from __future__ import annotations

import math

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


def error_response(path: str, exc: ServeAppError) -> JSONResponse:
    return openai_error(exc) if path.startswith("/v1/") else v2_error(exc)
