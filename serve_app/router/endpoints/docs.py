"""What the OpenAPI document says about the router's endpoints: error shapes and header help."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from serve_app.protocols import openai

PRIORITY_DOC = "high, normal or low (capped by the caller's tenant)"
SESSION_DOC = "sticky key: requests with the same key reach the same model version, where a model's traffic policy says so"
TIMEOUT_DOC = "deadline in milliseconds; refused at once if it cannot be met, ended with a 504 if it passes"


class V2Error(BaseModel):
    """The Open Inference Protocol's error shape."""

    error: str


V2_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": V2Error, "description": why}
    for code, why in [
        (400, "invalid input"),
        (401, "missing or unknown API key"),
        (404, "unknown model, route or version"),
        (413, "body too large"),
        (429, "tenant rate limit (Retry-After)"),
        (503, "overloaded or circuit open (Retry-After)"),
        (504, "deadline passed while queued"),
    ]
}
# Load and unload: operators only, and only where operator keys are configured.
REPOSITORY_ERRORS: dict[int | str, dict[str, Any]] = {
    **V2_ERRORS,
    403: {"model": V2Error, "description": "not an operator, or no operator key is configured"},
}
OPENAI_ERRORS: dict[int | str, dict[str, Any]] = {code: {**v, "model": openai.ErrorBody} for code, v in V2_ERRORS.items()}

# /infer reads its body itself (the binary extension is not JSON), so its schema is added here.
INFER_BODY = {
    "requestBody": {
        "required": True,
        "description": "JSON tensors; or, with the Inference-Header-Content-Length header, this JSON followed by "
        "binary tensor data (Triton's binary_tensor_data extension)",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/InferRequest"}}},
    }
}
