"""What an unexpected exception at the edge becomes for the client, in the protocol's shape."""

from __future__ import annotations

import logging

from ray.serve.exceptions import DeploymentUnavailableError

from serve_app.errors import UNAVAILABLE_RETRY_S, ModelFailure, ServeAppError, Unavailable

logger = logging.getLogger("ray.serve")


def served_error(error: BaseException) -> ServeAppError:
    """A model's deployment that Serve reports unavailable (its replicas failed to start, or none
    is running) is a 503 with Retry-After, not a fault of the router: anything else unexpected
    is a 500 that names only the exception's type (its text may carry internals)."""
    if isinstance(error, ServeAppError):
        return error
    if isinstance(error, DeploymentUnavailableError):
        return Unavailable(
            "the model's replicas are not running (they failed to start, or are starting again); `serve status` says why",
            retry_after_s=UNAVAILABLE_RETRY_S,
        )
    return ModelFailure(f"internal error: {type(error).__name__}")


def unexpected(path: str, error: BaseException) -> ServeAppError:
    """`served_error`, logged as what it is: a deployment Serve reports unavailable is a state of
    the cluster (`serve status` has its reason), one line; anything else a fault, with its traceback."""
    served = served_error(error)
    if isinstance(error, DeploymentUnavailableError):
        logger.warning("answered 503 on %s: %s", path, error)
    else:
        logger.error("unhandled error on %s", path, exc_info=error)
    return served
