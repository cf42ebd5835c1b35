"""One error hierarchy for the whole application.

Each class carries its HTTP status; `serve_app.protocols.errors` turns them
into each protocol's own error body, in exactly one place. Exceptions cross
Ray process boundaries, so they keep their data in `args` to stay picklable.
"""

from __future__ import annotations


class ServeAppError(Exception):
    status_code: int = 500
    code: str = "internal_error"

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message, retry_after_s)

    def _own(self) -> ServeAppError:
        # Ray re-raises a replica's exception in the caller as a subclass of its class whose
        # args are (the original exception,): read the data from the original.
        inner = self.args[0] if self.args else None
        return inner if isinstance(inner, ServeAppError) else self

    @property
    def message(self) -> str:
        return str(self._own().args[0])

    @property
    def retry_after_s(self) -> float | None:
        args = self._own().args
        return args[1] if len(args) > 1 else None

    def __str__(self) -> str:
        return self.message


class InvalidInput(ServeAppError):
    status_code = 400
    code = "invalid_input"


class Unauthorized(ServeAppError):
    status_code = 401
    code = "unauthorized"


class Forbidden(ServeAppError):
    status_code = 403
    code = "forbidden"


class NotFound(ServeAppError):
    status_code = 404
    code = "not_found"


class PayloadTooLarge(ServeAppError):
    status_code = 413
    code = "payload_too_large"


class RateLimited(ServeAppError):
    status_code = 429
    code = "rate_limited"


class ModelFailure(ServeAppError):
    status_code = 500
    code = "model_error"


class Overloaded(ServeAppError):
    status_code = 503
    code = "overloaded"


class DeadlineExceeded(ServeAppError):
    """The request's own deadline passed while it waited; retrying it as is cannot help."""

    status_code = 504
    code = "deadline_exceeded"


class Unavailable(ServeAppError):
    status_code = 503
    code = "unavailable"


# A model that cannot load, or whose replicas cannot start, stays so until it is deployed again.
UNAVAILABLE_RETRY_S = 30.0


def cannot_load(model: str, reason: str) -> Unavailable:
    """The 503 for a request to a model whose files cannot load, with the reason."""
    return Unavailable(f"model {model} cannot load: {reason}", retry_after_s=UNAVAILABLE_RETRY_S)
